"""One LLM used from several threads: each call runs under the speculation installed when its requests
are admitted; a stream never shows text its final output drops while another thread steps; an abandoned
stream that the garbage collector finalizes inside a step does not break that step."""

from __future__ import annotations

import gc
import threading

from draftwise import LLM, SamplingParams
from draftwise.engine.engine import Engine
from draftwise.engine.sequence import Sequence

PROMPT = "The quick brown fox"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}


def build(tiny_qwen, speculative=None) -> LLM:
    return LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=4, progress=False, speculative=speculative)


def test_a_call_runs_under_the_speculation_installed_when_it_is_admitted(tiny_qwen, monkeypatch):
    llm = build(tiny_qwen, NGRAM)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = build(tiny_qwen).generate(PROMPT, params)[0].token_ids
    make = llm._make_sequence

    def made_then_swapped(*args, **kwargs):  # (another thread's set_speculative, between making and adding)
        seq = make(*args, **kwargs)
        llm.set_speculative(None)
        return seq

    monkeypatch.setattr(llm, "_make_sequence", made_then_swapped)
    output = llm.generate(PROMPT, params)[0]
    assert output.error is None and output.token_ids == expected


def stop_across_a_token_boundary(llm, params) -> tuple[str, int]:
    """A two-character stop string whose characters two tokens of the greedy answer end and begin
    (so it completes in the step after its first character is committed), and that token's index."""
    ids = llm.generate(PROMPT, params)[0].token_ids
    texts = [llm.tokenizer.decode(ids[:i + 1]) for i in range(len(ids))]
    for k in range(len(ids) - 1):
        before, after = texts[k], texts[k + 1]
        if before and after.startswith(before) and len(after) > len(before):
            stop = before[-1] + after[len(before)]
            if stop not in before and stop.strip() == stop:
                return stop, k
    raise AssertionError("no token boundary to test at")


def test_a_stream_shows_no_text_that_its_final_output_drops_while_another_thread_steps(tiny_qwen, monkeypatch):
    llm = build(tiny_qwen)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    stop, _ = stop_across_a_token_boundary(llm, greedy)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    other_thread_steps, stepped = threading.Event(), threading.Event()
    done = threading.Event()

    def stepper():  # (another thread whose steps advance every running request)
        while not done.is_set():
            if other_thread_steps.wait(0.05):
                other_thread_steps.clear()
                llm._step()
                stepped.set()

    text_of = Sequence.text.fget
    raced = []

    def text_read_then_a_step_elsewhere(seq):
        value = text_of(seq)
        if not raced and not seq.finished and value.endswith(stop[0]):
            raced.append(value)  # (once: the other thread may commit the stop's second character now)
            other_thread_steps.set()
            stepped.wait(0.5)
        return value

    thread = threading.Thread(target=stepper)
    thread.start()
    try:
        monkeypatch.setattr(Sequence, "text", property(text_read_then_a_step_elsewhere))
        deltas = [delta for delta in llm.stream(PROMPT, params)]
    finally:
        done.set()
        thread.join(10)
    assert raced, "the race was never set up"
    final = deltas[-1].output
    assert final.finish_reason == "stop"
    assert "".join(d.text for d in deltas) == final.text


def test_a_stream_finalized_by_the_garbage_collector_inside_a_step_waits_for_its_end(tiny_qwen, monkeypatch):
    llm = build(tiny_qwen)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = build(tiny_qwen).generate(["def add(a, b):"], params)[0].token_ids
    abandoned = llm.stream(PROMPT, params)
    next(abandoned), next(abandoned)
    cycle = [abandoned]
    cycle.append(cycle)  # (only the cyclic collector finalizes it: at whatever allocation it runs)
    del abandoned, cycle
    verify, isolated, collected = Engine._verify_and_commit, [], []

    def collecting_mid_step(self, batch, *args, **kwargs):
        if len(batch) == 2 and not collected:
            collected.append(gc.collect())
        return verify(self, batch, *args, **kwargs)

    monkeypatch.setattr(Engine, "_verify_and_commit", collecting_mid_step)
    monkeypatch.setattr(Engine, "_isolate", lambda self, *args: isolated.append(args[-1]))
    output = llm.generate(["def add(a, b):"], params)[0]
    assert collected and not isolated, isolated
    assert output.token_ids == expected
    assert not llm.has_unfinished_requests()
    assert llm.runner.blocks.num_free_blocks == llm.runner.blocks.num_blocks
