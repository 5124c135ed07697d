"""Token trees through the whole engine: output token-identical to plain decoding, alone and batched
beside chains and plain rows, with a stop token or max_tokens inside an accepted path, for greedy
and seeded requests; and a tree holding the target's own continuation behind a wrong first sibling
at every level is accepted to its full depth (the tree's counterpart of the target drafting for
itself: verifying a tree computes what one-token steps compute, along its root paths)."""

from __future__ import annotations

import pytest

from draftwise import LLM, SamplingParams
from draftwise.speculative.control.policy import FixedLength
from draftwise.speculative.drafter import Drafter
from draftwise.speculative.proposer import CachelessProposer, Draft
from tests.drafting import assert_drafted

PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):\n    print(", "héllo wörld", "x"]
GREEDY = SamplingParams(temperature=0, max_tokens=20)
SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=11, max_tokens=20)


class OracleTree(CachelessProposer):
    """Knows each request's plain output. Tree rows (even prompt length) get, at every level, a
    wrong token first and then the right one, the next level below the right one: parents
    [-1, -1, 1, 1, 3, 3, ...]. Chain rows (odd) get the right continuation as a chain, every other
    row in a batch a chain, so trees, chains and plain rows (a k of 0) share batches."""

    def __init__(self, reference: dict, vocab_size: int) -> None:
        self.reference, self.vocab_size = reference, vocab_size
        self.tree_depths: list[int] = []  # per tree drafted: its depth

    def propose(self, seqs, num_tokens):
        drafts = []
        for seq, k in zip(seqs, num_tokens):
            truth = self.reference[seq.prompt][len(seq.output_ids):]
            if len(seq.prompt) % 2:
                drafts.append(Draft(truth[:k]))
                continue
            tokens, parents = [], []
            for depth, token in enumerate(truth[:k // 2]):
                above = 2 * depth - 1  # the right token of the level above (-1: the root)
                tokens += [(token + 1) % self.vocab_size, token]
                parents += [above, above]
            if tokens:
                self.tree_depths.append(len(tokens) // 2)
            drafts.append(Draft(tokens, parents=parents if tokens else None))
        return drafts


@pytest.fixture(scope="module")
def llm(tiny_qwen):
    return LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False)


def with_oracle(llm, params, k=8):
    reference = {prompt: llm.generate(prompt, params)[0].token_ids for prompt in PROMPTS}
    oracle = OracleTree(reference, llm.tokenizer.vocab_size)
    llm.engine.add_drafter("oracle", Drafter(oracle, FixedLength(k), k))
    return reference, oracle


def generate_with(llm, prompts, params, method):
    requests = {llm.add_request(prompt, params, speculative={"method": method}): prompt for prompt in prompts}
    outputs = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                outputs[requests[output.request_id]] = output
    return outputs


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_trees_beside_chains_and_plain_rows_equal_plain_decoding(llm, params):
    reference, oracle = with_oracle(llm, params)
    solo = {prompt: generate_with(llm, [prompt], params, "oracle")[prompt] for prompt in PROMPTS}
    batched = generate_with(llm, PROMPTS, params, "oracle")
    for run in (solo, batched):
        assert {p: o.token_ids for p, o in run.items()} == reference
    trees = [solo[p] for p in PROMPTS if len(p) % 2 == 0]
    total = assert_drafted(trees)
    # Every tree is accepted to its full depth: half its nodes (the right ones), each step.
    assert total.num_accepted_tokens * 2 == total.num_draft_tokens
    assert max(oracle.tree_depths) == 4
    assert total.acceptance_rate_per_position == [1.0] * len(total.drafted_per_position)  # by depth


def test_a_stop_token_or_max_tokens_inside_an_accepted_path(llm):
    base = llm.generate(PROMPTS[0], GREEDY)[0].token_ids
    for params in (SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[base[6]]),
                   SamplingParams(temperature=0, max_tokens=7)):
        reference, _ = with_oracle(llm, GREEDY, k=16)  # the oracle drafts past the stop
        expected = llm.generate(PROMPTS[0], params)[0]
        got = generate_with(llm, [PROMPTS[0]], params, "oracle")[PROMPTS[0]]
        assert got.token_ids == expected.token_ids and got.finish_reason == expected.finish_reason
        assert len(got.token_ids) <= 7
