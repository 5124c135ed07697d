"""Verification of a token tree: keep the longest root path the target agrees with.

A tree draft is token ids x_0..x_{k-1} with parents (-1: a child of the root, the row's newest
committed token; parents come first). The target's pass gives logits at the root (index 0) and at
every node i (index i + 1): the distribution of the token after the node's path.

Greedy and seeded rows walk down from the root: at each node the target's own token (its argmax,
or its keyed draw for the output position the node predicts: `verify.py` says why that draw keeps
seeded sampling exact) is compared with the node's children; a child that equals it is accepted and
the walk goes on from there, else the target's token is emitted and the step ends. The emitted
tokens are the target's at every position, exactly what one-token-at-a-time decoding emits.

Unseeded sampled rows use recursive rejection sampling over siblings (SpecInfer, Miao et al. 2024,
"multi-step speculative sampling"; Jeon et al. 2024 for candidates drawn without replacement). At a
node, let p be the target's (warped) distribution of the next token and x_1..x_m the node's
children in order, x_j drawn from q_j given everything drafted before it (a point mass for
deterministic drafters; a draft model's distribution with the earlier siblings removed when it
samples siblings without replacement). With r_1 = p:
  for j = 1..m: accept x_j with probability min(1, r_j(x_j) / q_j(x_j)), and on acceptance go on
                from x_j's node; on rejection r_{j+1} = norm(max(0, r_j - q_j));
  if every child was rejected, emit a draw from r_{m+1} (a leaf: a draw from p, the bonus token).
Proof that the token emitted at the node follows p. Stage j alone is one-draft speculative sampling
with target r_j: accept x_j ~ q_j with probability min(1, r_j/q_j), else draw from
norm(max(0, r_j - q_j)); it emits x with probability min(q_j(x), r_j(x)) + (1 - sum_y min(q_j(y),
r_j(y))) * max(0, r_j(x) - q_j(x)) / sum_y max(0, r_j(y) - q_j(y)) = r_j(x), because the two sums
are equal (sum r_j = sum q_j = 1) (Leviathan et al. 2023, Theorem 1). In the rule above, "draw from
r_{j+1}" is replaced by stage j + 1, whose candidate x_{j+1} and uniform are drawn afresh given the
past; by induction from the last stage (which draws from r_{m+1} itself) stage j + 1 emits r_{j+1}
exactly, so stage j emits r_j, and stage 1 emits r_1 = p. (Where r_j - q_j has no positive mass,
r_j = q_j and rejection never happens.) An accepted child's own children are tested the same way
against the target's distribution after it, so by the chain rule every emitted sequence follows
the target's distribution. `tests/test_tree_verification.py` checks it by Monte Carlo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftwise.cache import token_tree
from draftwise.sampling.sampler import SamplingBatch, sample, sample_from_probs, sampling_probs
from draftwise.speculative.verify import residual_probs


@dataclass(slots=True)
class TreeVerifyResult:
    output_token_ids: list[list[int]]  # [B][a + 1]: the accepted path's tokens, then the target's own
    accepted_nodes: list[list[int]]  # [B][a]: the draft indices along the accepted path, root first


def children_of(parents: list[int]) -> list[list[int]]:
    """[k + 1][...] the children of the root (index 0) and of each node i (index i + 1), in order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        children[parent + 1].append(i)
    return children


def node_depths(parents: list[int]) -> list[int]:
    """[k + 1] how many tokens past the root each logit index predicts beyond the first (root: 0)."""
    return [0] + [depth + 1 for depth in token_tree.depths(parents)]


def verify_tree(
    draft_token_ids: list[list[int]],  # [B][k_b]
    parents: list[list[int]],  # [B][k_b]
    target_logits: torch.Tensor,  # [B, K+1, V]: row b's root, then its nodes (padding past k_b)
    draft_probs: list[torch.Tensor | None],  # [B] each [k_b, V'] (V' <= V): q of each node; None: point masses
    sampling: SamplingBatch,  # one row per sequence, positions: the output position of each row's root logit
) -> TreeVerifyResult:
    batch, width_plus_one, vocab = target_logits.shape
    chosen = _target_tokens(target_logits, parents, sampling).tolist()  # [B][K+1] (the step's host sync)
    greedy = sampling.greedy.tolist()
    outputs, paths = [], []
    for b in range(batch):
        children = children_of(parents[b])
        if greedy[b] or sampling.seeds[b] is not None:
            output, path = _walk_by_equality(draft_token_ids[b], children, chosen[b])
        else:
            row = sampling.select([b])
            probs = sampling_probs(target_logits[b, :len(parents[b]) + 1], row.repeat(len(parents[b]) + 1))
            output, path = _walk_by_rejection(draft_token_ids[b], children, probs, draft_probs[b])
        outputs.append(output)
        paths.append(path)
    return TreeVerifyResult(outputs, paths)


def _target_tokens(target_logits: torch.Tensor, parents: list[list[int]], sampling: SamplingBatch) -> torch.Tensor:
    """[B, K+1]: the target's argmax at every node, or for seeded rows its keyed draw for the output
    position the node predicts (its depth past the row's position)."""
    chosen = target_logits.argmax(dim=-1)
    for b, seed in enumerate(sampling.seeds):
        if seed is None:
            continue
        depths = node_depths(parents[b])
        per_node = sampling.select([b]).repeat(len(depths))
        per_node.positions = [sampling.positions[b] + depth for depth in depths]
        chosen[b, :len(depths)] = sample(target_logits[b, :len(depths)], per_node)
    return chosen


def _walk_by_equality(tokens: list[int], children: list[list[int]], chosen: list[int]) -> tuple[list[int], list[int]]:
    node, path = 0, []  # node: a logit index (0: the root)
    while True:
        want = chosen[node]
        match = next((i for i in children[node] if tokens[i] == want), None)
        if match is None:
            return [tokens[i] for i in path] + [want], path
        path.append(match)
        node = match + 1


def _walk_by_rejection(tokens: list[int], children: list[list[int]], target_probs: torch.Tensor,
                       draft_probs: torch.Tensor | None) -> tuple[list[int], list[int]]:
    """target_probs [k+1, V]; draft_probs [k, V'] or None (point masses)."""
    vocab = target_probs.shape[-1]
    node, path = 0, []
    while True:
        residual = target_probs[node]  # r_1 = p
        accepted = None
        for i in children[node]:
            q = _proposal(draft_probs, i, tokens[i], vocab, residual)
            if float(torch.rand(())) * float(q[tokens[i]]) <= float(residual[tokens[i]]):  # u <= r/q
                accepted = i
                break
            residual = residual_probs(residual, q)
        if accepted is None:
            final = int(sample_from_probs(residual[None], None))
            return [tokens[i] for i in path] + [final], path
        path.append(accepted)
        node = accepted + 1


def _proposal(draft_probs: torch.Tensor | None, node: int, token: int, vocab: int, like: torch.Tensor) -> torch.Tensor:
    """q [V] the node's token was drawn from: the drafter's distribution, or a point mass."""
    if draft_probs is None:
        q = torch.zeros(vocab, dtype=like.dtype, device=like.device)
        q[token] = 1.0
        return q
    q = draft_probs[node].to(like.dtype)
    return q if q.shape[-1] == vocab else torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))
