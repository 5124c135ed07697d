"""Logprobs of generated tokens, from the verification pass: equal to a teacher-forced reference, and
under speculation (every drafter) equal to plain decoding's; over HTTP in OpenAI's chat and
completions shapes, streamed too; and the processors' fields accepted by the server."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from draftwise import LLM, SamplingParams
from tests.drafting import DRAFTERS as DRAFTERS_ALL, assert_drafted

PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):\n    print("]


@pytest.fixture(scope="module")
def plain(tiny_qwen):
    return LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False)


def test_logprobs_are_the_models_log_softmax_at_each_generated_position(plain):
    output = plain.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, logprobs=3))[0]
    ids = plain.tokenizer.encode(PROMPTS[0]) + output.token_ids
    with torch.no_grad():
        logits = plain.model(torch.tensor([ids]), torch.arange(len(ids))[None])[0].float()
    expected = torch.log_softmax(logits, -1)[len(ids) - len(output.token_ids) - 1:-1]  # [n, V]
    assert len(output.logprobs) == len(output.token_ids)
    for position, (token, entry) in enumerate(zip(output.token_ids, output.logprobs)):
        assert entry[token].rank == 1  # greedy: the most likely
        assert math.isclose(entry[token].logprob, float(expected[position, token]), abs_tol=1e-4)
        top = expected[position].topk(3).indices.tolist()
        assert [t for t, lp in sorted(entry.items(), key=lambda item: item[1].rank)] == top
        for t, lp in entry.items():  # vLLM's decoded_token: the token's text alone, special tokens written
            assert lp.decoded_token == plain.tokenizer.decode([t], skip_special_tokens=False)
    assert output.outputs[0].logprobs == output.logprobs
    assert any(lp.decoded_token.strip() for entry in output.logprobs for lp in entry.values())


DRAFTERS = {name: DRAFTERS_ALL[name] for name in ("draft=target", "random draft", "draft=target tree", "ngram")}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_speculative_logprobs_equal_plain(drafter, tiny_qwen, random_draft, plain, drafting_pays):
    llm = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False,
              speculative=DRAFTERS[drafter](tiny_qwen, random_draft))
    for params in (SamplingParams(temperature=0, max_tokens=20, logprobs=2),
                   SamplingParams(temperature=0.9, seed=11, max_tokens=20, logprobs=0, presence_penalty=0.5)):
        expected = plain.generate(PROMPTS, params)
        got = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        for mine, theirs in zip(got, expected):
            assert len(mine.logprobs) == len(theirs.logprobs)
            for a, b in zip(mine.logprobs, theirs.logprobs):
                assert a.keys() == b.keys()
                assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 and a[t].rank == b[t].rank for t in a)
        assert_drafted(got, accepted=drafter.startswith("draft=target"))


# --- over HTTP ------------------------------------------------------------------------------------
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tiny_qwen):
    from tests.live_server import LiveServer

    live = LiveServer(LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=4, progress=False,
                          speculative={"method": "ngram", "num_speculative_tokens": 3}), "tiny")
    yield live
    live.stop()


def test_chat_and_completion_logprobs_in_openais_shapes(server, plain):
    client = server.client()
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          temperature=0, max_tokens=10, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert content and all(len(item.top_logprobs) == 3 and item.top_logprobs[0].logprob >= item.logprob - 1e-6
                           for item in content)
    assert "".join(item.token for item in content) == chat.choices[0].message.content
    assert all(bytes(item.bytes).decode("utf-8", "replace") for item in content)
    completion = client.completions.create(model="tiny", prompt="def add(a, b):", temperature=0, max_tokens=10,
                                           logprobs=2)
    logprobs = completion.choices[0].logprobs
    expected = plain.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=10, logprobs=2))[0]
    assert logprobs.token_logprobs == pytest.approx([e[t].logprob for t, e in zip(expected.token_ids,
                                                                                 expected.logprobs)], abs=1e-5)
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert logprobs.text_offset[0] == 0  # (tokens decoding to the same text share a key of top_logprobs)
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)


def test_streamed_logprobs_add_up_to_the_whole_ones(server):
    client = server.client()
    fields = dict(model="tiny", prompt="for i in range(10):", temperature=0, max_tokens=16, logprobs=1)
    whole = client.completions.create(**fields).choices[0].logprobs.token_logprobs
    streamed = []
    for chunk in client.completions.create(**fields, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == pytest.approx(whole, abs=1e-6)


def test_the_server_takes_the_processors_fields(server, plain):
    body = {"model": "tiny", "prompt": "def add(a, b):", "temperature": 0, "max_tokens": 12,
            "presence_penalty": 1.0, "frequency_penalty": 0.5, "logit_bias": {"40": 5}, "repetition_penalty": 1.3,
            "min_tokens": 3, "bad_words": ["the"], "stop_token_ids": [41]}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    expected = plain.generate("def add(a, b):", SamplingParams(
        temperature=0, max_tokens=12, presence_penalty=1.0, frequency_penalty=0.5, logit_bias={40: 5},
        repetition_penalty=1.3, min_tokens=3, bad_words=["the"], stop_token_ids=[41]))[0]
    assert answer["choices"][0]["text"] == expected.text
    refused = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"
    refused = httpx.post(server.url + "/v1/completions", timeout=30, json={**body, "presence_penalty": 5})
    assert refused.status_code == 400 and "presence_penalty" in refused.json()["error"]["message"]


def test_n_and_best_of_in_the_library(plain):
    params = SamplingParams(temperature=1.0, seed=4, n=2, best_of=4, max_tokens=10)
    out = plain.generate(PROMPTS[:2], params)
    assert len(out) == 2 and all(len(o.outputs) == 2 for o in out)
    for o in out:
        scores = [c.cumulative_logprob for c in o.outputs]
        assert scores == sorted(scores, reverse=True) and o.outputs[0].logprobs is None  # (not asked for)
        singles = [plain.generate(PROMPTS[out.index(o)], SamplingParams(temperature=1.0, seed=4 + j,
                                                                         max_tokens=10, logprobs=0))[0]
                   for j in range(4)]
        best = sorted(singles, key=lambda s: -sum(e[t].logprob for t, e in zip(s.token_ids, s.logprobs)))[:2]
        assert [c.token_ids for c in o.outputs] == [s.token_ids for s in best]
    with pytest.raises(Exception, match="n and best_of above 1 are served by generate"):
        plain.add_request("x", SamplingParams(n=2))


def test_n_choices_over_http(server):
    client = server.client()
    answer = client.completions.create(model="tiny", prompt="def add(a, b):", temperature=1.0, seed=1, n=3,
                                       max_tokens=8, logprobs=0)
    assert [c.index for c in answer.choices] == [0, 1, 2] and len({c.text for c in answer.choices}) > 1
    best = client.completions.create(model="tiny", prompt="def add(a, b):", temperature=1.0, seed=1, n=1, best_of=3,
                                     max_tokens=8, logprobs=0)
    totals = [sum(c.logprobs.token_logprobs) for c in answer.choices]
    assert sum(best.choices[0].logprobs.token_logprobs) == pytest.approx(max(totals), abs=1e-4)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                          temperature=1.0, seed=2, max_tokens=6)
    assert len(chat.choices) == 2 and chat.usage.completion_tokens > 6  # (both samples counted)


def test_prompt_logprobs(tiny_qwen):
    plain = LLM(str(tiny_qwen), max_model_len=512, progress=False)
    prompt = "def add(a, b):\n    return a + b\n" * 20  # (longer than one chunk of the LM head: 256 positions)
    output = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))[0]
    ids = output.prompt_token_ids
    assert len(output.prompt_logprobs) == len(ids) > 256 and output.prompt_logprobs[0] is None
    with torch.no_grad():
        logits = plain.model(torch.tensor([ids]), torch.arange(len(ids))[None])[0].float()
    expected = torch.log_softmax(logits, -1)
    for p in (1, 100, 257, len(ids) - 1):
        entry = output.prompt_logprobs[p]
        assert abs(entry[ids[p]].logprob - float(expected[p - 1, ids[p]])) < 1e-4
        assert len([lp for lp in entry.values() if lp.rank <= 2]) == 2
        assert all(lp.decoded_token == plain.tokenizer.decode([t], skip_special_tokens=False) for t, lp in entry.items())


def test_echo_with_logprobs_lists_the_prompt_first(server):
    client = server.client()
    answer = client.completions.create(model="tiny", prompt="def add(a, b):", echo=True, logprobs=1, temperature=0,
                                       max_tokens=4)
    choice = answer.choices[0]
    assert choice.text.startswith("def add(a, b):") and "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.token_logprobs[0] is None and all(lp is not None for lp in choice.logprobs.token_logprobs[1:])
    assert choice.model_extra["prompt_logprobs"][0] is None
    streamed = [c for c in client.completions.create(model="tiny", prompt="def add(a, b):", echo=True, logprobs=1,
                                                     temperature=0, max_tokens=4, stream=True) if c.choices]
    values = [v for c in streamed if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert values == choice.logprobs.token_logprobs


def test_n_choices_stream_side_by_side(server):
    client = server.client()
    fields = dict(model="tiny", prompt="def add(a, b):", temperature=1.0, seed=5, n=3, max_tokens=8, logprobs=0)
    whole = client.completions.create(**fields)
    texts, reasons, logprobs = {}, {}, {}
    for chunk in client.completions.create(**fields, stream=True, stream_options={"include_usage": True}):
        if not chunk.choices:
            usage = chunk.usage
            continue
        choice = chunk.choices[0]
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        logprobs.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs if choice.logprobs else [])
        if choice.finish_reason:
            reasons[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(3)] == [c.text for c in whole.choices]
    assert [logprobs[i] for i in range(3)] == [c.logprobs.token_logprobs for c in whole.choices]
    assert set(reasons) == {0, 1, 2} and usage.completion_tokens == whole.usage.completion_tokens
    chat = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                               temperature=1.0, seed=2, max_tokens=5, stream=True))
    assert {c.choices[0].index for c in chat if c.choices} == {0, 1}


def test_prompt_logprobs_in_a_chat_answer_and_refused_with_stream(server):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
            "prompt_logprobs": 1}
    answer = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()
    listed = answer["prompt_logprobs"]  # (vLLM's place: beside the choices)
    assert listed[0] is None and len(listed) == answer["usage"]["prompt_tokens"] and len(listed[1]) >= 1
    for path, body in (("/v1/chat/completions", chat),
                       ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3, "prompt_logprobs": 1})):
        refused = httpx.post(server.url + path, json={**body, "stream": True}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_errors_name_the_field_that_is_wrong(server):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 25}, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "word " * 400}]}, "messages"),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "logit_bias": {"\u00b2": 1}},
         "logit_bias"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "assistant", "name": "bob", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].name"),
    ]
    for path, body, param in cases:
        response = httpx.post(server.url + path, json=body, timeout=60)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, response.text


def test_a_client_gone_before_its_samples_begin_aborts_them_all(server):
    """n = 12 samples on 4 rows are admitted together (before, each sample waited for the one before it
    to begin, so at most 5 were ever in the engine, and the rest ran on after the client left), and a
    client that leaves takes them all with it."""
    import json
    import socket
    import time
    from urllib.parse import urlparse

    body = json.dumps({"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 200, "ignore_eos": True, "n": 12,
                       "temperature": 1.0, "seed": 3}).encode()
    address = urlparse(server.url)
    llm = server.llm
    with socket.create_connection((address.hostname, address.port), timeout=30) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline, most = time.time() + 30, 0
        while time.time() < deadline and most < 12:
            stats = llm.engine_stats()
            most = max(most, stats["running"] + stats["waiting"])
            time.sleep(0.005)
        assert most == 12  # every sample in the engine at once
    deadline = time.time() + 30
    while time.time() < deadline:
        stats = llm.engine_stats()
        if stats["running"] == 0 and stats["waiting"] == 0:
            break
        time.sleep(0.05)
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_in_use"] == 0
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert 'reason="client_disconnected"' in metrics
