"""Tree verification (`draftwise/speculative/verify_tree.py`) as a pure function.

Greedy and seeded rows keep exactly the root path the target's own tokens take. Unseeded sampled
rows: Monte Carlo over whole decodes of two tokens, each step verifying a fresh tree (two siblings
at the root, one child under each), with the emitted pairs checked against the target's joint
distribution p(t1) p(t2 | t1) by Pearson's chi-square test; for siblings that are point masses
(a deterministic drafter's top two) and for siblings sampled without replacement from a draft
distribution. The same run with the residual replaced by p (the classic bug) must fail it (with
6,000 decodes: p-values 0.47 and 0.19 correct, 6e-275 and 0 with the bug).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from draftwise.sampling.params import SamplingParams
from draftwise.sampling.sampler import SamplingBatch, sample, sampling_probs
from draftwise.speculative import verify_tree as tree_module
from draftwise.speculative.verify_tree import children_of, node_depths, verify_tree
from tests.test_speculative_sampling import chi_square

VOCAB = 6
TRIALS = 2000
ALPHA = 1e-4
PARAMS = SamplingParams(temperature=0.9, top_k=5)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def table(seed: int):
    """A conditional distribution's logits: prefix (tuple) -> [V]."""
    cache = {}

    def logits(prefix: tuple) -> torch.Tensor:
        if prefix not in cache:
            generator = torch.Generator().manual_seed(hash((seed, prefix)) % 2**31)
            cache[prefix] = 2.0 * torch.randn(VOCAB, generator=generator)
        return cache[prefix]
    return logits


TARGET = table(1)
DRAFT = table(2)


def batch_of(params, positions=(0,)):
    return SamplingBatch.build([params] * len(positions), list(positions), VOCAB, torch.device("cpu"))


def tree_for(prefix: tuple, sampled_siblings: bool):
    """Two children of the root, one child under each: tokens, parents, q per node (or None)."""
    root_q = sampling_probs(DRAFT(prefix)[None], batch_of(PARAMS))[0]
    if sampled_siblings:  # x1 ~ q, x2 ~ q without x1: q_2 is q renormalised without x1
        first = int(torch.multinomial(root_q, 1))
        second_q = root_q.clone()
        second_q[first] = 0
        second_q /= second_q.sum()
        second = int(torch.multinomial(second_q, 1))
        below = [sampling_probs(DRAFT(prefix + (x,))[None], batch_of(PARAMS))[0] for x in (first, second)]
        grandchildren = [int(torch.multinomial(q, 1)) for q in below]
        probs = torch.stack([root_q, second_q, below[0], below[1]])
    else:  # a deterministic drafter's top two, and the top one below each
        first, second = root_q.topk(2).indices.tolist()
        grandchildren = [int(DRAFT(prefix + (x,)).argmax()) for x in (first, second)]
        probs = None
    return [first, second, *grandchildren], [-1, -1, 0, 1], probs


def target_logits_for(prefix: tuple, tokens: list[int], parents: list[int]) -> torch.Tensor:
    """[1, k+1, V]: the target at the root and after each node's path."""
    paths = [()]
    for token, parent in zip(tokens, parents):
        paths.append(paths[parent + 1] + (token,))
    return torch.stack([TARGET(prefix + path) for path in paths])[None]


def decode_two(sampled_siblings: bool) -> tuple:
    out: tuple = ()
    while len(out) < 2:
        tokens, parents, probs = tree_for(out, sampled_siblings)
        result = verify_tree([tokens], [parents], target_logits_for(out, tokens, parents), [probs],
                             batch_of(PARAMS, [len(out)]))
        out += tuple(result.output_token_ids[0])
    return out[:2]


def exact_pairs() -> dict:
    first = sampling_probs(TARGET(())[None], batch_of(PARAMS))[0]
    joint = {}
    for a in range(VOCAB):
        second = sampling_probs(TARGET((a,))[None], batch_of(PARAMS))[0]
        for b in range(VOCAB):
            joint[(a, b)] = float(first[a] * second[b])
    return joint


def pairs_p_value(sampled_siblings: bool) -> float:
    torch.manual_seed(0)
    counts = Counter(decode_two(sampled_siblings) for _ in range(TRIALS))
    return chi_square(counts, exact_pairs(), TRIALS)[2]


def test_tree_helpers():
    assert children_of([-1, -1, 0, 1, 0]) == [[0, 1], [2, 4], [3], [], [], []]
    assert node_depths([-1, -1, 0, 1, 0]) == [0, 1, 1, 2, 2, 2]


def test_greedy_keeps_the_path_the_targets_argmax_takes():
    tokens, parents = [3, 4, 1, 2, 5], [-1, -1, 1, 1, 3]  # root -> {3, 4}; 4 -> {1, 2}; 2 -> {5}
    logits = torch.zeros(1, 6, VOCAB)
    for node, best in enumerate([4, 0, 2, 0, 5, 1]):  # root: 4; node 1 (4): 2; node 3 (2): 5; node 4 (5): 1
        logits[0, node, best] = 1.0
    result = verify_tree([tokens], [parents], logits, [None], batch_of(SamplingParams(temperature=0)))
    assert result.accepted_nodes == [[1, 3, 4]]
    assert result.output_token_ids == [[4, 2, 5, 1]]
    logits[0, 0] = 0
    logits[0, 0, 0] = 1.0  # the root wants 0: no child has it
    result = verify_tree([tokens], [parents], logits, [None], batch_of(SamplingParams(temperature=0)))
    assert result.accepted_nodes == [[]] and result.output_token_ids == [[0]]


def test_seeded_rows_keep_the_path_of_the_targets_keyed_draws():
    params = SamplingParams(temperature=1.0, seed=7)
    prefix = (2,)
    expected = []
    for position in range(1, 4):  # what plain seeded decoding emits at output positions 1, 2, 3
        expected.append(int(sample(TARGET(prefix + tuple(expected))[None], batch_of(params, [position]))[0]))
    decoy = (expected[0] + 1) % VOCAB
    tokens, parents = [decoy, expected[0], expected[1]], [-1, -1, 1]
    result = verify_tree([tokens], [parents], target_logits_for(prefix, tokens, parents), [None],
                         batch_of(params, [1]))
    assert result.accepted_nodes == [[1, 2]]
    assert result.output_token_ids == [expected]


@pytest.mark.parametrize("sampled_siblings", [False, True])
def test_sampled_trees_emit_the_targets_distribution(sampled_siblings):
    assert pairs_p_value(sampled_siblings) > ALPHA


@pytest.mark.parametrize("sampled_siblings", [False, True])
def test_the_test_sees_a_residual_replaced_by_p(monkeypatch, sampled_siblings):
    monkeypatch.setattr(tree_module, "residual_probs", lambda target, draft: target)
    assert pairs_p_value(sampled_siblings) < ALPHA


def test_rows_of_a_batch_are_verified_each_by_its_own_rule():
    random.seed(0)
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.0)
    tokens, parents = [int(TARGET(()).argmax()), 0], [-1, 0]
    logits = torch.cat([target_logits_for((), tokens, parents)] * 2)
    batch = SamplingBatch.build([greedy, sampled], [0, 0], VOCAB, torch.device("cpu"))
    result = verify_tree([tokens, tokens], [parents, parents], logits, [None, None], batch)
    assert result.accepted_nodes[0][:1] == [0]
    assert len(result.output_token_ids[1]) == len(result.accepted_nodes[1]) + 1
