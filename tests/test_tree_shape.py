"""How much of a tree is verified (`control/tree_shape.py`), and how the draft model lays its tree out
(`autoregressive.chain_with_leaves`): the chain first and whole, leaves best first, siblings in draw order."""

import torch

from draftwise.speculative.autoregressive import chain_with_leaves
from draftwise.speculative.control.tree_shape import nodes_that_pay

FLAT = lambda n: 1.0  # noqa: E731  a GPU-like curve: any number of tokens costs one step
STEEP = lambda n: 1.0 + 0.3 * (n - 1)  # noqa: E731  a CPU-like one: each token 0.3 of a step


def test_the_nodes_that_pay_depend_on_the_cost_curve():
    scores = [0.9, 0.6, 0.3, 0.1]
    assert nodes_that_pay(scores, FLAT) == 4  # free tokens: every node
    # 1.9/1.3 = 1.46, 2.5/1.6 = 1.56, 2.8/1.9 = 1.47: two nodes
    assert nodes_that_pay(scores, STEEP) == 2
    assert nodes_that_pay([0.1, 0.05], STEEP) == 0  # a plain step beats them
    assert nodes_that_pay([0.1, 0.05, 0.9], STEEP, keep=1) >= 1  # kept nodes stay


def test_in_a_batch_a_node_pays_for_the_slope_where_the_pass_already_is():
    """On a curve flat up to 4 tokens, a row alone verifies three likely nodes for free; beside 7
    rows the pass is already 8 tokens, on the steep part, and the same nodes do not pay there."""
    cpu = lambda n: max(1.0, n / 4)  # noqa: E731
    scores = [0.9, 0.6, 0.3]
    assert nodes_that_pay(scores, cpu) == 3
    assert nodes_that_pay(scores, lambda m: cpu(m + 7), beside=7) == 0
    assert nodes_that_pay([0.99, 0.98], lambda m: cpu(m + 7), beside=7) == 0  # compute-bound: nothing can
    sublinear = lambda m: 1 + 0.15 * (m + 6)  # noqa: E731  (each token 0.15 of a step)
    assert nodes_that_pay([0.99, 0.98], sublinear, beside=7) == 2  # near-certain nodes still pay there


def test_the_draft_models_tree_keeps_its_chain_and_orders_siblings_as_drawn():
    chain, confidences = [10, 11, 12], [0.5, 0.9, 0.8]
    leaves = [[(20, 0.3, None), (21, 0.4, None)], [(22, 0.05, None)], []]  # 21 drawn after 20, likelier
    draft = chain_with_leaves(chain, confidences, leaves, [])
    assert draft.token_ids[:3] == chain and draft.parents[:3] == [-1, 0, 1] and draft.kept_nodes == 3
    assert draft.first_children().token_ids == chain
    order = draft.token_ids[3:]
    assert order.index(20) < order.index(21)  # 21's score capped at 20's
    assert draft.scores[3:] == sorted(draft.scores[3:], reverse=True)
    assert draft.parents[draft.token_ids.index(22)] == 0  # beside chain token 1: below chain token 0
    probs = [torch.full((4,), 0.25)] * 3
    with_probs = chain_with_leaves([1, 2, 3], confidences, [[(0, 0.2, torch.ones(4) / 4)], [], []], probs)
    assert with_probs.probs.shape == (4, 4)
