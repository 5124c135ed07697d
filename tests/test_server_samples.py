"""n > 1 through the server when a sample fails or the client leaves: the other samples are aborted at
once, a stream ends cleanly (its error event, then [DONE]), the request counts once, nothing is held."""

import json
import time

import httpx
import pytest

pytest.importorskip("uvicorn")

from draftwise import LLM, SamplingParams  # noqa: E402
from tests.live_server import LiveServer, settled  # noqa: E402

MODEL = "tiny"
ABORTED = 'draftwise:request_aborted_total{model_name="tiny",reason="client_disconnected"}'
BODY = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "n": 2}


@pytest.fixture(scope="module")
def llm(tiny_qwen):
    return LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=4, progress=False,
               speculative={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})


@pytest.fixture(scope="module")
def server(llm):
    live = LiveServer(llm, MODEL)
    yield live
    live.stop()


@pytest.fixture
def one_sample_fails(llm, monkeypatch) -> dict[str, int]:
    """The first sample to reach 5 tokens raises in its drafter from then on (it fails; its sibling
    does not). Returns the tokens each request had when last drafted for."""
    proposer = llm.engine.drafters["ngram"].proposer
    propose, seen, victim = proposer.propose, {}, []

    def faulty_propose(seqs, num_tokens):
        for seq in seqs:
            seen[seq.request_id] = len(seq.output_ids)
            if len(seq.output_ids) >= 5 and not victim:
                victim.append(seq.request_id)
            if victim and seq.request_id == victim[0]:
                raise RuntimeError("injected drafter fault")
        return propose(seqs, num_tokens)

    monkeypatch.setattr(proposer, "propose", faulty_propose)
    return seen


def metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_a_failed_sample_aborts_its_siblings_at_once(server, llm, one_sample_fails):
    response = httpx.post(server.url + "/v1/completions", json=BODY, timeout=60)
    assert response.status_code == 500 and "injected drafter fault" in response.json()["error"]["message"]
    stats = settled(llm)
    assert stats["running"] == 0 and stats["kv_blocks_in_use"] == 0
    assert len(one_sample_fails) == 2 and max(one_sample_fails.values()) < 100  # (it ran to 200 before)


def test_a_stream_whose_sample_fails_ends_with_its_error_and_done(server, llm, one_sample_fails):
    with httpx.stream("POST", server.url + "/v1/completions", json={**BODY, "stream": True}, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data:")]  # (read to the end, cleanly)
    assert '"error"' in lines[-2] and "injected drafter fault" in lines[-2] and lines[-1] == "data: [DONE]"
    stats = settled(llm)
    assert stats["running"] == 0 and stats["kv_blocks_in_use"] == 0


def test_a_client_that_leaves_a_stream_of_samples_aborts_them_and_counts_once(server, llm, monkeypatch):
    step = llm.engine.step

    def slow_step():  # (the samples cannot run to their end before the server hears the client leave)
        time.sleep(0.03)
        return step()

    monkeypatch.setattr(llm.engine, "step", slow_step)
    before = metric(server, ABORTED)
    for _ in range(3):
        with httpx.stream("POST", server.url + "/v1/completions", json={**BODY, "stream": True},
                          timeout=30) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
    stats = settled(llm)
    assert stats["running"] == 0 and stats["kv_blocks_in_use"] == 0
    deadline = time.time() + 10
    while time.time() < deadline and metric(server, ABORTED) < before + 3:
        time.sleep(0.05)
    assert metric(server, ABORTED) == before + 3


# --- a batch of prompts (completions' `prompt` as a list): a request per prompt, choices in order ---
BATCH = ["def add(a, b):", "The quick brown fox", "for i in range(10):\n    print("]


@pytest.fixture(scope="module")
def reference(tiny_qwen):
    return LLM(str(tiny_qwen), max_model_len=256, progress=False)


def test_a_batch_of_prompts_answers_each_in_order_with_its_samples(server, llm, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    answer = client.completions.create(model=MODEL, prompt=BATCH, n=2, temperature=0, max_tokens=12)
    outputs = reference.generate(BATCH, SamplingParams(temperature=0, max_tokens=12))
    expected = [o.text for o in outputs]
    assert [c.index for c in answer.choices] == list(range(6))
    assert [c.text for c in answer.choices] == [text for text in expected for _ in range(2)]
    prompt_tokens = sum(len(reference.tokenizer.encode(p)) for p in BATCH)
    assert answer.usage.prompt_tokens == prompt_tokens
    assert answer.usage.completion_tokens == 2 * sum(len(o.token_ids) for o in outputs)
    ids = [reference.tokenizer.encode(p) for p in BATCH[:2]]
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=12, echo=True)
    assert [c.text for c in by_ids.choices] == [BATCH[i] + expected[i] for i in range(2)]
    assert settled(llm)["kv_blocks_in_use"] == 0


def test_a_streamed_batch_names_each_choice_and_echoes_its_own_prompt(server, llm, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    texts: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(model=MODEL, prompt=BATCH, temperature=0, max_tokens=10, echo=True,
                                           stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
        usage = chunk.usage or usage
    expected = [o.text for o in reference.generate(BATCH, SamplingParams(temperature=0, max_tokens=10))]
    assert texts == {i: BATCH[i] + expected[i] for i in range(3)}
    assert usage.prompt_tokens == sum(len(reference.tokenizer.encode(p)) for p in BATCH)


@pytest.mark.parametrize("prompt, message", [
    (["ok", [1, 2]], "prompt"),  # (a mix of text and token ids is not one of the schema's forms)
    ([[1, 2], []], "prompt[1] is empty"),
    (["x"] * 129, "at most 128"),
])
def test_a_bad_batch_is_refused_by_name(server, prompt, message):
    response = httpx.post(server.url + "/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    assert response.json()["error"]["param"] == "prompt"


def test_a_batch_with_a_prompt_too_long_is_refused_and_runs_nothing(server, llm):
    response = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": ["def f(x):", "word " * 400], "max_tokens": 4})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
    stats = settled(llm)
    assert stats["running"] == 0 and stats["kv_blocks_in_use"] == 0


def test_choices_carry_vllms_stop_reason_streamed_or_not(server, reference):
    full = reference.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_at = next(i for i, t in enumerate(full.token_ids) if t not in full.token_ids[:i] and i >= 3)
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stop_token_ids": [full.token_ids[stop_at]]}
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == full.token_ids[stop_at]
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    assert events[-1]["choices"][0]["stop_reason"] == full.token_ids[stop_at]
    plain = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}).json()
    assert plain["choices"][0]["finish_reason"] == "length" and plain["choices"][0]["stop_reason"] is None
