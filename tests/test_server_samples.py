"""n > 1 through the server when a sample fails or the client leaves: the other samples are aborted at
once, a stream ends cleanly (its error event, then [DONE]), the request counts once, nothing is held."""

import time

import httpx
import pytest

pytest.importorskip("uvicorn")

from draftwise import LLM  # noqa: E402
from tests.live_server import LiveServer  # noqa: E402

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


def settled(llm) -> dict:
    deadline = time.time() + 20
    while time.time() < deadline:
        stats = llm.engine_stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_in_use"] == 0:
            break
        time.sleep(0.05)
    return stats


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


def test_a_client_that_leaves_a_stream_of_samples_aborts_them_and_counts_once(server, llm):
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
