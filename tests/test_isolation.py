"""One request's fault ends that request alone: injected faults in the target's forward pass, the
drafter and the block manager; every other request finishes with exactly its solo output."""

import threading
import time

import pytest

from draftwise import LLM, SamplingParams
from draftwise.errors import KVCacheFullError

PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):\n    print(", "héllo wörld",
           "x = np.zeros((3, 4))\nx = np.zeros((3, 4))\nx = np."]
GREEDY = SamplingParams(temperature=0, max_tokens=20)
POISONED = 2  # the index of the request whose fault is injected


@pytest.fixture(scope="module")
def solo_outputs(tiny_qwen):
    llm = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=1, progress=False)
    return [llm.generate(prompt, GREEDY)[0].token_ids for prompt in PROMPTS]


def build(tiny_qwen, spec):
    return LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False, speculative=spec)


def run_all(llm):
    """Every prompt through the step API at once; the outputs in prompt order, and the request ids."""
    ids = [llm.add_request(prompt, GREEDY) for prompt in PROMPTS]
    finished = {}
    while llm.has_unfinished_requests():
        finished.update({o.request_id: o for o in llm.step() if o.finished})
    return [finished[i] for i in ids], ids


def remember_poisoned(llm, monkeypatch) -> dict:
    """{"seq": the poisoned request's Sequence} once it is added (faults key on its cache row)."""
    state, add = {}, llm.add_request

    def add_and_remember(prompt, params, **kwargs):
        request_id = add(prompt, params, **kwargs)
        if prompt == PROMPTS[POISONED]:
            state["seq"] = llm._live[request_id]
        return request_id

    monkeypatch.setattr(llm, "add_request", add_and_remember)
    return state


def assert_only_the_poisoned_failed(llm, outputs, solo_outputs, message):
    for i, output in enumerate(outputs):
        if i == POISONED:
            assert output.finish_reason == "error" and message in output.error
        else:
            assert output.finish_reason in ("stop", "length") and output.error is None
            assert output.token_ids == solo_outputs[i], i
    blocks = llm.runner.blocks
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_blocks  # nothing leaked


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}],
                         ids=["plain", "ngram"])
def test_a_fault_in_the_forward_pass_of_one_row_fails_that_request_alone(tiny_qwen, solo_outputs, spec,
                                                                           monkeypatch):
    llm = build(tiny_qwen, spec)
    forward, state = llm.runner.forward, remember_poisoned(llm, monkeypatch)

    def faulty_forward(rows, token_ids, num_logits, **kwargs):
        seq = state.get("seq")
        if seq is not None and seq.row in rows and seq.output_ids:  # in decode steps, once it has a row
            raise RuntimeError("injected fault in the forward pass")
        return forward(rows, token_ids, num_logits, **kwargs)

    monkeypatch.setattr(llm.runner, "forward", faulty_forward)
    outputs, _ = run_all(llm)
    assert_only_the_poisoned_failed(llm, outputs, solo_outputs, "injected fault in the forward pass")
    assert len(outputs[POISONED].token_ids) == 1  # its prefill's token, then the fault


def test_a_drafter_that_raises_for_one_request_fails_that_request_alone(tiny_qwen, solo_outputs, monkeypatch):
    llm = build(tiny_qwen, {"method": "draft", "model": str(tiny_qwen), "num_speculative_tokens": 3,
                            "adaptive": False})
    proposer = llm.engine.drafters["draft"].proposer
    propose = proposer.propose

    def faulty_propose(seqs, num_tokens):
        if any(seq.prompt == PROMPTS[POISONED] for seq in seqs):
            raise ValueError("injected drafter fault")
        return propose(seqs, num_tokens)

    monkeypatch.setattr(proposer, "propose", faulty_propose)
    outputs, _ = run_all(llm)
    assert_only_the_poisoned_failed(llm, outputs, solo_outputs, "injected drafter fault")
    assert llm.spec_metrics.num_accepted_tokens > 0  # the others kept speculating
    assert not proposer._rows  # the drafter's cache rows were all given back


def test_a_row_that_cannot_grow_its_kv_fails_alone(tiny_qwen, solo_outputs, monkeypatch):
    llm = build(tiny_qwen, None)
    blocks, state = llm.runner.blocks, remember_poisoned(llm, monkeypatch)
    grow = blocks.grow

    def tight_grow(handle, length):
        seq = state.get("seq")
        if seq is not None and handle == seq.row and seq.output_ids:
            raise KVCacheFullError("injected: no free block for this row")
        grow(handle, length)

    monkeypatch.setattr(blocks, "grow", tight_grow)
    outputs, _ = run_all(llm)
    assert_only_the_poisoned_failed(llm, outputs, solo_outputs, "no free block")


def test_an_engine_wide_fault_ends_every_request_with_an_error(tiny_qwen, monkeypatch):
    llm = build(tiny_qwen, {"method": "ngram", "num_speculative_tokens": 3})
    forward = llm.runner.forward
    calls = []

    def broken_after_the_first_prefill(rows, token_ids, num_logits, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("the engine is broken")
        return forward(rows, token_ids, num_logits, **kwargs)

    monkeypatch.setattr(llm.runner, "forward", broken_after_the_first_prefill)
    outputs, _ = run_all(llm)
    assert all(o.finish_reason == "error" and "the engine is broken" in o.error for o in outputs)
    assert not llm.has_unfinished_requests()
    assert llm.runner.blocks.num_free_blocks == llm.runner.blocks.num_blocks


def test_generate_returns_the_others_when_one_fails(tiny_qwen, solo_outputs, monkeypatch):
    llm = build(tiny_qwen, None)
    forward = llm.runner.forward

    def faulty_forward(rows, token_ids, num_logits, **kwargs):
        if any(len(ids) > 1 and ids[:4] == llm.tokenizer.encode(PROMPTS[POISONED])[:4] for ids in token_ids):
            raise RuntimeError("injected prefill fault")
        return forward(rows, token_ids, num_logits, **kwargs)

    monkeypatch.setattr(llm.runner, "forward", faulty_forward)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert outputs[POISONED].finish_reason == "error" and outputs[POISONED].token_ids == []
    assert [o.token_ids for i, o in enumerate(outputs) if i != POISONED] == \
        [ids for i, ids in enumerate(solo_outputs) if i != POISONED]


def test_a_failed_pass_waits_for_its_masks_before_the_rows_run_again(tiny_qwen, monkeypatch):
    """The grammar masks compute on their own thread beside the pass; when the pass fails, the rows
    run again alone (isolation), and their grammars must not be used by both threads at once."""
    from draftwise.engine import constrained
    from draftwise import StructuredOutputsParams

    llm = build(tiny_qwen, None)
    fill, filling, overlaps = constrained.fill_masks, threading.Event(), []

    def slow_fill(*args):
        filling.set()
        time.sleep(0.2)
        try:
            return fill(*args)
        finally:
            filling.clear()

    init = constrained.PendingMasks.__init__

    def noting_init(self, batch, drafts, vocab_size):
        overlaps.append(filling.is_set())  # (the grammars are about to be synced: nobody else may use them)
        init(self, batch, drafts, vocab_size)

    forward, failed = llm.runner.forward, []

    def fails_once_with_two_rows(rows, token_ids, num_logits, **kwargs):
        if len(rows) == 2 and not failed:
            failed.append(1)
            raise RuntimeError("injected: the pass failed")
        return forward(rows, token_ids, num_logits, **kwargs)

    monkeypatch.setattr(constrained, "fill_masks", slow_fill)
    monkeypatch.setattr(constrained.PendingMasks, "__init__", noting_init)
    monkeypatch.setattr(llm.runner, "forward", fails_once_with_two_rows)
    choice = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["alpha beta", "gamma delta"]))
    outputs = llm.generate(["Pick one:", "Another:"], choice)
    assert failed and all(o.error is None and o.finish_reason in ("stop", "length") for o in outputs), \
        [o.error for o in outputs]
    assert not any(overlaps), "a grammar was synced while the failed pass's masks still used it"
