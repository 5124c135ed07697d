"""The library's calls as a program uses them: from two threads at once, a Ctrl-C inside a step, a
stream finished by another call's steps, a drafter that cannot be built, malformed chat messages."""

from __future__ import annotations

import threading

import pytest

from draftwise import LLM, SamplingParams
from draftwise.errors import DraftwiseError, InvalidParameterError

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = ["def add(a, b):", "import numpy", "for i in range(10):", "The quick brown fox"]


@pytest.fixture(scope="module")
def plain(tiny_qwen):
    return LLM(str(tiny_qwen), max_model_len=128, max_num_seqs=4, progress=False)


@pytest.fixture
def drafting(tiny_qwen, random_draft, drafting_pays):
    return LLM(str(tiny_qwen), max_model_len=128, max_num_seqs=4, progress=False, speculative={
        "method": "draft", "model": str(random_draft), "num_speculative_tokens": 3, "adaptive": False,
        "quantization": "none"})


def test_two_threads_calling_generate_get_what_each_would_alone(drafting, plain):
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    results, errors = {}, []

    def run(name):
        try:
            results[name] = [[o.token_ids for o in drafting.generate(PROMPTS, GREEDY)] for _ in range(2)]
        except BaseException as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=run, args=(name,)) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert results == {"a": [expected, expected], "b": [expected, expected]}


def test_a_ctrl_c_inside_a_step_harms_no_other_request(drafting, plain, monkeypatch):
    """A KeyboardInterrupt after a step committed tokens, before its roll-back: the step-API request
    that shared the batch goes on exactly as plain decoding (it ended in an error, or wrong)."""
    expected = plain.generate(PROMPTS[2], GREEDY)[0].token_ids
    truncate, calls = drafting.runner.truncate, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return truncate(*args, **kwargs)

    monkeypatch.setattr(drafting.runner, "truncate", interrupted)
    request_id = drafting.add_request(PROMPTS[2], GREEDY)
    with pytest.raises(KeyboardInterrupt):
        drafting.generate(PROMPTS[:2], GREEDY)
    monkeypatch.undo()
    finished = None
    while drafting.has_unfinished_requests():
        finished = next((o for o in drafting.step() if o.request_id == request_id and o.finished), finished)
    assert finished.error is None and finished.token_ids == expected
    assert drafting.generate(PROMPTS[2], GREEDY)[0].token_ids == expected


def test_a_ctrl_c_inside_a_prefill_leaves_that_request_waiting_and_the_engine_stepping(drafting, plain,
                                                                                      monkeypatch):
    """Interrupted while a new request's prompt runs: that request goes back to the queue (it held no
    row yet), and every request then finishes exactly as plain decoding computes it."""
    first = drafting.add_request(PROMPTS[0], GREEDY)
    drafting.step()  # (its prefill)
    second = drafting.add_request(PROMPTS[1], GREEDY)
    drafting.step()  # (a decoding step: the next one admits the second request)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(drafting.runner, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        drafting.step()
    monkeypatch.undo()
    finished = {}
    while drafting.has_unfinished_requests():
        finished.update({o.request_id: o for o in drafting.step() if o.finished})
    assert {request_id: finished[request_id].token_ids for request_id in (first, second)} == {
        first: plain.generate(PROMPTS[0], GREEDY)[0].token_ids, second: plain.generate(PROMPTS[1], GREEDY)[0].token_ids}
    assert drafting.engine_stats()["kv_blocks_in_use"] == 0


def test_a_stream_another_call_finished_still_ends_with_its_output(plain):
    stream = plain.stream(PROMPTS[0], GREEDY)
    first = next(stream)
    plain.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))  # runs it to its end
    rest = list(stream)
    last = (rest or [first])[-1]
    assert last.finish_reason == "length" and last.output is not None
    assert first.text + "".join(delta.text for delta in rest) == last.output.text


def test_a_drafter_that_cannot_be_built_leaves_the_llm_as_it_was(tiny_qwen, plain):
    llm = LLM(str(tiny_qwen), max_model_len=128, progress=False, speculative={"method": "ngram"})
    with pytest.raises(DraftwiseError):
        llm.set_speculative({"method": "layer_skip", "num_layers": 99})
    assert llm.speculative.method == "ngram" and list(llm.engine.drafters) == ["ngram"]
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == plain.generate(PROMPTS[0], GREEDY)[0].token_ids


@pytest.mark.parametrize("messages, message", [
    ("hello", "messages must be a conversation"),
    ({"role": "user", "content": "hi"}, "messages must be a conversation"),
    (None, "messages must be a conversation"),
    ([], "messages must be a conversation"),
    ([{"role": "user", "content": None}], "messages\\[0\\].content is missing"),
    ([{"role": "user"}], "messages\\[0\\].content is missing"),
    ([{"content": "hi"}], "messages\\[0\\].role"),
    ([[{"role": "user", "content": "hi"}], [{"role": "user", "content": 5}]], "messages\\[1\\]\\[0\\].content must be"),
])
def test_malformed_chat_messages_are_named(plain, messages, message):
    with pytest.raises(InvalidParameterError, match=message):
        plain.chat(messages, GREEDY)


@pytest.mark.parametrize("enabled", ["false", 0, None])
def test_a_per_request_enabled_that_is_not_a_bool_is_refused(tiny_qwen, enabled):
    llm = LLM(str(tiny_qwen), max_model_len=128, progress=False, speculative={"method": "ngram"})
    with pytest.raises(InvalidParameterError, match="speculative.enabled must be true or false"):
        llm.add_request(PROMPTS[0], GREEDY, speculative={"enabled": enabled})


def test_resetting_the_prefix_cache_waits_for_a_running_step(plain):
    """A step takes and frees blocks while it runs: a reset from another thread waits for it."""
    done = threading.Event()
    with plain._lock:  # (as a step on another thread holds it)
        resetting = threading.Thread(target=lambda: (plain.reset_prefix_cache(), done.set()))
        resetting.start()
        assert not done.wait(0.3)
    assert done.wait(10)
    resetting.join()
