"""The OpenAI-compatible server on loopback, driven by the official `openai` client (tiny model)."""

import json
import re
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from draftwise import LLM, SamplingParams  # noqa: E402
from draftwise.server.app import ServerOptions  # noqa: E402
from tests.live_server import LiveServer, settled  # noqa: E402
from draftwise.speculative.control.live_costs import LiveCostModel  # noqa: E402
from tests.drafting import DRAFTING_PAYS  # noqa: E402

MODEL = "tiny"


class PredictingOnly(LiveCostModel):
    """Live costs that predict each step (for the metrics) but keep planning with their prior."""

    def _refit_target(self) -> None:
        pass

    def observe_draft(self, *args, **kwargs) -> None:
        pass


def served_llm(tiny_qwen):
    """Adaptive prompt lookup, planning with a cost model on which drafting pays (what it measures
    on the tiny model may say it never does; then no comparison below would involve a draft)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("draftwise.speculative.drafter.load_or_measure", lambda *args, **kwargs: DRAFTING_PAYS)
        patch.setattr("draftwise.speculative.drafter.live_costs",
                      lambda target, proposer, config: PredictingOnly(DRAFTING_PAYS))
        llm = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=4, progress=False,
                  speculative={"method": "ngram", "num_speculative_tokens": 3})
        llm.prepare_drafter("suffix")  # offered per request, as `draftwise serve` offers every cheap drafter
        return llm


@pytest.fixture(scope="module")
def llm(tiny_qwen):
    """The server's LLM: only its engine thread may run it (tests read its stats)."""
    return served_llm(tiny_qwen)


@pytest.fixture(scope="module")
def reference(tiny_qwen):
    """Plain decoding, in-process: what every server response must equal."""
    return LLM(str(tiny_qwen), max_model_len=256, progress=False)


@pytest.fixture(scope="module")
def server(llm):
    live = LiveServer(llm, MODEL)
    yield live
    live.stop()


GREEDY = dict(temperature=0, max_tokens=24)


def test_completion_chat_and_models(server, reference):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    completion = client.completions.create(model=MODEL, prompt="def add(a, b):", **GREEDY)
    expected = reference.generate("def add(a, b):", SamplingParams(**GREEDY))[0]
    assert completion.choices[0].text == expected.text
    assert completion.choices[0].finish_reason == expected.finish_reason
    assert completion.usage.completion_tokens == len(expected.token_ids)
    assert completion.usage.speculation["num_draft_tokens"] > 0
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}], **GREEDY)
    expected_chat = reference.chat([{"role": "user", "content": "hello there"}], SamplingParams(**GREEDY))[0]
    assert chat.choices[0].message.content == expected_chat.text
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.speculation["num_draft_tokens"] > 0


def test_streaming_equals_non_streaming_equals_generate(server, reference):
    client = server.client()
    prompt = "for i in range(10):\n    print("
    expected = reference.generate(prompt, SamplingParams(**GREEDY))[0].text
    whole_completion = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    whole = whole_completion.choices[0].text
    assert whole_completion.usage.speculation["num_draft_tokens"] > 0
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, stream=True, **GREEDY))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole == expected
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    chat_chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    chat_text = "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices)
    assert chat_text == reference.chat([{"role": "user", "content": prompt}], SamplingParams(**GREEDY))[0].text
    assert chat_chunks[-1].usage.completion_tokens > 0 and chat_chunks[-1].usage.speculation["num_draft_tokens"] > 0


def test_per_request_speculation_and_its_usage(server):
    client = server.client()
    prompt = "x = np.zeros((3, 4))\nx = np.zeros((3, 4))\nx = np.zeros((3, 4))\nx = np."
    on = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    off = client.completions.create(model=MODEL, prompt=prompt, extra_body={"speculative": {"enabled": False}},
                                    **GREEDY)
    fixed = client.completions.create(model=MODEL, prompt=prompt, **GREEDY,
                                      extra_body={"speculative": {"method": "ngram", "num_speculative_tokens": 2}})
    assert on.choices[0].text == off.choices[0].text == fixed.choices[0].text
    assert on.usage.speculation["num_draft_tokens"] > 0
    assert not getattr(off.usage, "speculation", None)
    assert fixed.usage.speculation["num_draft_tokens"] > 0


def test_per_request_suffix_decoding_drafts_a_repeated_request_from_the_first(server, reference):
    client = server.client()
    prompt = "def reverse(items):"
    extra = {"speculative": {"method": "suffix", "num_speculative_tokens": 6}, "ignore_eos": True}
    first = client.completions.create(model=MODEL, prompt=prompt, **GREEDY, extra_body=extra)
    again = client.completions.create(model=MODEL, prompt=prompt, **GREEDY, extra_body=extra)
    expected = reference.generate(prompt, SamplingParams(**GREEDY, ignore_eos=True))[0].text
    assert first.choices[0].text == again.choices[0].text == expected
    speculation = again.usage.speculation
    assert speculation["num_draft_tokens"] >= 12 and speculation["num_accepted_tokens"] == speculation["num_draft_tokens"]


def test_api_key_guards_everything_but_health(tiny_qwen):
    live = LiveServer(served_llm(tiny_qwen), MODEL, ServerOptions(api_key="sesame"))
    try:
        assert live.client("sesame").completions.create(model=MODEL, prompt="hi", **GREEDY).choices
        with pytest.raises(openai.AuthenticationError):
            live.client("wrong").completions.create(model=MODEL, prompt="hi", **GREEDY)
        assert httpx.get(live.url + "/health").status_code == 200
        assert httpx.get(live.url + "/metrics").status_code == 401
    finally:
        live.stop()


def test_each_api_key_is_a_tenant_whose_text_drafts_only_its_own_requests(tiny_qwen):
    from draftwise.server.security import tenant_of

    llm = served_llm(tiny_qwen)
    live = LiveServer(llm, MODEL, ServerOptions(api_key=("alpha", "beta")))
    prompt, extra = "count: one two three", {"speculative": {"method": "suffix", "num_speculative_tokens": 6},
                                             "ignore_eos": True}
    try:
        live.client("alpha").completions.create(model=MODEL, prompt=prompt, **GREEDY, extra_body=extra)
        again = live.client("alpha").completions.create(model=MODEL, prompt=prompt, **GREEDY, extra_body=extra)
        live.client("beta").completions.create(model=MODEL, prompt="other words", **GREEDY, extra_body=extra)
        with pytest.raises(openai.AuthenticationError):
            live.client("gamma").completions.create(model=MODEL, prompt="hi", **GREEDY)
    finally:
        live.stop()
    speculation = again.usage.speculation  # (alpha's second request drafted from alpha's first)
    assert speculation["num_draft_tokens"] >= 12 and speculation["num_accepted_tokens"] == speculation["num_draft_tokens"]
    cache = llm.engine.drafters["suffix"].proposer.cache
    assert set(cache.partitions) == {tenant_of(b"alpha"), tenant_of(b"beta")}  # (each key's text apart; no key's)


def test_cache_salt_and_api_keys_partition_the_prefix_cache(tiny_qwen):
    """vLLM's cache_salt field, and each key's tenant: a request finds prefix blocks only of requests
    with the same key and salt (time to first token tells a tenant nothing of another's prompts)."""
    llm = served_llm(tiny_qwen)
    live = LiveServer(llm, MODEL, ServerOptions(api_key=("alpha", "beta")))
    prompt = "You are a careful assistant. " * 4 + "def add(a, b):"

    def hits_of(key: str, **extra) -> int:
        before = llm.engine_stats()["prefix_cache_hits"]
        answer = live.client(key).completions.create(model=MODEL, prompt=prompt, **GREEDY, extra_body=extra)
        hits = llm.engine_stats()["prefix_cache_hits"] - before
        assert answer.usage.prompt_tokens_details.cached_tokens == hits  # (OpenAI's usage field)
        return hits

    try:
        assert hits_of("alpha") == 0
        assert hits_of("beta") == 0 and hits_of("alpha") > 0
        assert hits_of("alpha", cache_salt="s1") == 0 and hits_of("alpha", cache_salt="s1") > 0
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            live.client("alpha").completions.create(model=MODEL, prompt=prompt, **GREEDY, extra_body={"cache_salt": ""})
    finally:
        live.stop()


def test_an_empty_api_key_is_refused_by_name():
    from draftwise.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="api_key: an API key must be a non-empty string"):
        ServerOptions(api_key=("alpha", " "))


@pytest.mark.parametrize("body, status, message", [
    ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 10**6}, 400, "context"),
    ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "prompt": 42}, 400, "prompt"),
    ({"model": MODEL, "prompt": "word " * 400}, 400, "context"),
    ({"model": "gpt-9", "prompt": "hi"}, 404, "gpt-9"),
    ({"model": MODEL, "prompt": "hi", "speculative": {"method": "magic"}}, 400, "speculative"),
    ({"model": MODEL, "prompt": "hi", "segment": "a b"}, 400, "segment"),
    ({"model": MODEL, "messages": []}, 400, "prompt"),
])
def test_bad_input_is_a_4xx_with_an_openai_error_body(server, body, status, message):
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and error["type"]


def test_malformed_json_and_bad_chat_bodies(server):
    response = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    response = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": "hi"}, timeout=30)
    assert response.status_code == 400 and "messages" in response.json()["error"]["message"]


def test_client_disconnect_mid_stream_frees_its_blocks(server, llm):
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data:"))
    stats = settled(llm)
    assert stats["running"] == 0 and stats["kv_blocks_in_use"] == 0
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert 'draftwise:request_aborted_total{model_name="tiny",reason="client_disconnected"}' in metrics


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_non_streamed_request_whose_client_leaves_is_counted_once_as_aborted(server, llm, monkeypatch):
    step = llm.engine.step

    def slow_step():  # (the client leaves after its request began, before it ends)
        time.sleep(0.03)
        return step()

    monkeypatch.setattr(llm.engine, "step", slow_step)
    aborted = 'draftwise:request_aborted_total{model_name="tiny",reason="client_disconnected"}'
    as_finished = 'draftwise:request_success_total{finished_reason="abort",model_name="tiny"}'
    before = httpx.get(server.url + "/metrics", timeout=30).text
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    deadline = time.time() + 20
    while time.time() < deadline and (llm.engine_stats()["running"] or _metric(
            httpx.get(server.url + "/metrics", timeout=30).text, aborted) == _metric(before, aborted)):
        time.sleep(0.05)
    after = httpx.get(server.url + "/metrics", timeout=30).text
    assert _metric(after, aborted) == _metric(before, aborted) + 1
    assert _metric(after, as_finished) == _metric(before, as_finished) == 0


def test_metrics_count_speculation_per_segment(server):
    client = server.client()
    prompt = "x = 1\nx = 1\nx = 1\nx ="
    client.completions.create(model=MODEL, prompt=prompt, extra_body={"segment": "code-completion"}, **GREEDY)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert "draftwise:request_success_total" in text
    assert 'draftwise:spec_decode_num_draft_tokens_total{method="ngram",model_name="tiny",segment="code-completion"}' in text
    assert "draftwise:time_to_first_token_seconds_bucket" in text and "draftwise:kv_cache_usage_perc" in text
    steps = re.search(r'^draftwise:decode_steps_total\{model_name="tiny"\} ([0-9.]+)', text, re.M)
    drafting = re.search(r'^draftwise:spec_decode_drafting_steps_total\{model_name="tiny"\} ([0-9.]+)', text, re.M)
    assert steps and drafting and 0 < float(drafting.group(1)) <= float(steps.group(1))
    predictions = re.search(r'^draftwise:spec_decode_step_time_predicted_over_observed_count\{model_name="tiny"\} '
                            r'([0-9.]+)', text, re.M)
    assert predictions and float(predictions.group(1)) > 0  # the adaptive drafter's live costs predicted steps
    client.completions.create(model=MODEL, prompt=prompt * 8, **GREEDY)
    client.completions.create(model=MODEL, prompt=prompt * 8 + " 2", **GREEDY)  # (its first blocks cached)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    hits = re.search(r'^draftwise:prefix_cache_hits_total\{model_name="tiny"\} ([0-9.]+)', text, re.M)
    queries = re.search(r'^draftwise:prefix_cache_queries_total\{model_name="tiny"\} ([0-9.]+)', text, re.M)
    assert hits and queries and 16 <= float(hits.group(1)) < float(queries.group(1))


def test_load_48_concurrent_streaming_clients_lose_nothing(server, reference, llm):
    """Bounded load: 48 streaming clients at once on loopback (the server runs 4 at a time, the
    rest queue); every stream completes, ends with [DONE], and equals plain decoding."""
    import asyncio

    prompts = [f"def f{i}(x):" + " return x" * (i % 5) for i in range(48)]
    params = dict(temperature=0, max_tokens=12)
    expected = [o.text for o in reference.generate(prompts, SamplingParams(**params))]

    async def one(client, prompt):
        body = {"model": MODEL, "prompt": prompt, "stream": True, **params}
        text, done = "", False
        async with client.stream("POST", server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert done
        return text

    async def all_clients():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    drafted_before = llm.spec_metrics.num_draft_tokens
    assert asyncio.run(all_clients()) == expected
    assert llm.spec_metrics.num_draft_tokens > drafted_before


def test_serve_seed_seeds_the_engines_random_stream(tiny_qwen):
    """`draftwise serve --seed N` (vLLM's flag) builds the engine with LLM(seed=N): its requests
    without a seed draw from the LLM's own seeded stream (tests/test_seeded.py)."""
    from draftwise.cli.serve import server_from_argv

    for extra, seeded in ((["--seed", "7"], True), ([], False)):
        app, engine = server_from_argv(["--model", str(tiny_qwen), "--max-model-len", "128", *extra])
        engine.drain(0.0)
        assert (engine.llm._random is not None) == seeded


def test_allowed_token_ids_through_the_server(server, reference):
    """vLLM's field, as an extra body field: the same tokens as the library's, and a bad id refused by name."""
    client = server.client()
    allowed = [14, 31, 37, 40, 41, 69, 70, 71, 72, 83, 84, 99] + list(range(260, 320))
    expected = reference.generate("def add(a, b):", SamplingParams(**GREEDY, allowed_token_ids=allowed))[0]
    got = client.completions.create(model=MODEL, prompt="def add(a, b):", **GREEDY,
                                    extra_body={"allowed_token_ids": allowed})
    assert got.choices[0].text == expected.text and set(expected.token_ids) <= set(allowed)
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids hold an id >= the vocabulary"):
        client.completions.create(model=MODEL, prompt="def", **GREEDY, extra_body={"allowed_token_ids": [5, 10**6]})
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids must be a non-empty list"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], **GREEDY,
                                       extra_body={"allowed_token_ids": []})


def test_truncate_prompt_tokens_through_the_server(server, reference):
    client = server.client()
    text = "def add(a, b):\n    return a + b\n" * 40  # [past the context of 256]
    with pytest.raises(openai.BadRequestError, match="prompt has"):
        client.completions.create(model=MODEL, prompt=text, **GREEDY)
    got = client.completions.create(model=MODEL, prompt=text, **GREEDY, extra_body={"truncate_prompt_tokens": 40})
    ids = reference.tokenizer.encode(text)[-40:]
    from draftwise import TokensPrompt
    assert got.usage.prompt_tokens == 40
    assert got.choices[0].text == reference.generate(TokensPrompt(prompt_token_ids=ids), SamplingParams(**GREEDY))[0].text
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens must be -1 or a positive integer"):
        client.completions.create(model=MODEL, prompt=text, **GREEDY, extra_body={"truncate_prompt_tokens": 0})


def test_chat_template_options_through_the_server(server, reference):
    """vLLM's chat fields chat_template_kwargs, add_generation_prompt and continue_final_message, as
    LLM.chat takes them; a client's own chat_template is refused by name (it would run on the server)."""
    client = server.client()
    hi = [{"role": "user", "content": "hi"}]
    started = [*hi, {"role": "assistant", "content": "The answer is"}]
    expected = reference.chat(started, SamplingParams(**GREEDY), add_generation_prompt=False, continue_final_message=True)[0]
    got = client.chat.completions.create(model=MODEL, messages=started, **GREEDY,
                                         extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert got.choices[0].message.content == expected.text and got.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert expected.prompt.endswith("assistant\nThe answer is")
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(model=MODEL, messages=started, **GREEDY, extra_body={"continue_final_message": True})
    with pytest.raises(openai.BadRequestError, match="reads no variable 'hint'"):  # (the tiny template reads none)
        client.chat.completions.create(model=MODEL, messages=hi, **GREEDY, extra_body={"chat_template_kwargs": {"hint": "x"}})
    with pytest.raises(openai.BadRequestError, match="chat_template is not taken from requests"):
        client.chat.completions.create(model=MODEL, messages=hi, **GREEDY, extra_body={"chat_template": "{{ 'x' * 9 }}"})
