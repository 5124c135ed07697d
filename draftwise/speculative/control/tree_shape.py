"""How much of a drafted token tree to verify: the part that pays on this machine's cost curve.

A tree drafter proposes its nodes best first, each with a score: its estimated probability of
being accepted (the product of the drafter's confidences, or the empirical frequency of its path).
A node is accepted only with its whole path, so a node never scores above its parent, and any
prefix of the list is a tree. Verifying the first n nodes emits, in expectation,
1 + (the sum of their scores) tokens in target_seconds(n + 1) plus the drafting already spent
(EAGLE-2's and Sequoia's reasoning, with this machine's measured curve in place of a fixed budget):
the n with the most tokens per second is kept, n = 0 (a plain step) included. A drafter may fix
its first nodes (a draft model's chain, whose length the controller chose from the acceptance it
has seen: the draft's own confidences estimate it worse); the rest are weighed the same way. On a GPU the curve is
flat up to dozens of tokens and wide trees pay; on a CPU a node must be likely to pay for itself.
"""

from __future__ import annotations

from typing import Callable


def nodes_that_pay(scores: list[float], target_seconds: Callable[[int], float], draft_seconds: float = 0.0,
                   keep: int = 0, beside: int = 0) -> int:
    """The n in keep..len(scores) maximizing (1 + sum(scores[:n])) / (draft_seconds + target_seconds(n + 1)).

    In a batch, `target_seconds(m)` is the whole pass with this row feeding m tokens, and the pass
    commits `beside` tokens of other rows too: the n maximizing the pass's goodput (beside + 1 +
    sum(scores[:n])) / (draft_seconds + target_seconds(n + 1)). A node then costs the curve's slope
    where the batch already is, not at its start: on a CPU, past the first few tokens of a pass, a
    node must be likelier to pay for itself."""
    expected = beside + 1.0 + sum(scores[:keep])
    best_n, best_rate = keep, expected / (draft_seconds + target_seconds(keep + 1))
    for n, score in enumerate(scores[keep:], start=keep + 1):
        expected += score
        rate = expected / (draft_seconds + target_seconds(n + 1))
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n
