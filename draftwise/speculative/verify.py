"""Verification of drafted tokens against the target: a pure function over padded tensors.

Words (as in vLLM): *accepted* tokens are drafted tokens the target keeps; the *recovered* token
replaces the first rejected draft; the *bonus* token follows when every draft was accepted. A row
that accepts `a` of its k drafts emits a + 1 tokens.

Greedy rows accept while draft == argmax(target); the emitted tokens are then simply the target's
argmax at positions 0..a, which is what one-token-at-a-time greedy decoding would produce.

Sampled rows use speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding", Algorithm 1; Chen et al. 2023): with p_i the target's and q_i the
drafter's distribution at position i (both after the same temperature / top-k / top-p warping),
  accept x_i with probability min(1, p_i(x_i) / q_i(x_i));
  at the first rejection, emit a draw from norm(max(0, p_i - q_i)) (the recovered token);
  if all k are accepted, emit a draw from p_k (the bonus token).
Every emitted token then follows p exactly. A deterministic drafter (n-gram) is a point mass
q_i = 1[x = x_i]: accept with probability p_i(x_i), recover from p_i with x_i removed.

Randomized drafting (`draft_rate` a < 1 for a row, sampled rows only): the engine flips a coin
c ~ Bernoulli(a) per step, independent of everything else. Heads: the draft is verified with the
first position's test relaxed to
  accept x_1 with probability min(1, p(x_1) / (a q(x_1))),  on rejection draw from R;
tails (`draft_skipped`): the target takes a plain step that draws from R instead of p, where
  R = norm(max(0, p - a q)).
Later positions use the ordinary test. Proof that the first emitted token follows p exactly:
with m(x) = min(a q(x), p(x)) and M = sum_x m(x), heads emits x by acceptance with probability
q(x) min(1, p(x)/(a q(x))) = m(x)/a, and rejects with probability 1 - M/a; so
  P(x) = (1 - a) R(x) + a [m(x)/a + (1 - M/a) R(x)] = m(x) + (1 - M) R(x).
Since R(x) = (p(x) - m(x)) / (1 - M) (the normaliser of max(0, p - a q) is sum p - m = 1 - M),
P(x) = m(x) + p(x) - m(x) = p(x). (If M = 1 then m = p and R is never needed.) Given x_1, the
later positions are ordinary speculative sampling, so the whole step follows the target. The
often-quoted form that accepts with min(1, p / (a q)) but lets the plain step draw from p is NOT
lossless: its tails branch gives (1 - a) p(x) instead of (1 - a) R(x), e.g. p = (1/2, 1/2),
q = (1, 0), a = 1/2 emits token 0 with probability 3/4. The Monte-Carlo test checks both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftwise.sampling.sampler import SamplingBatch, sample_from_probs, sampling_probs


@dataclass(slots=True)
class VerifyResult:
    output_token_ids: torch.Tensor  # [B, K+1]: row b's first num_accepted[b] + 1 entries, then -1
    num_accepted: torch.Tensor  # [B]


def residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim; where p == q exactly (rejection impossible) falls back to p."""
    residual = (target_probs - draft_probs).clamp_(min=0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp(min=1e-30), target_probs)


def verify(
    draft_token_ids: torch.Tensor,  # [B, K] (entries past num_draft are ignored)
    num_draft: torch.Tensor,  # [B]
    target_logits: torch.Tensor,  # [B, K+1, V]
    draft_probs: torch.Tensor | None,  # [B, K, V'] with V' <= V, or None: every draft is a point mass
    sampling: SamplingBatch,  # one row per sequence
    draft_rate: torch.Tensor | None = None,  # [B] randomized drafting's a per row (1: off)
    draft_skipped: torch.Tensor | None = None,  # [B] bool: the coin said "plain step" (first token from R)
) -> VerifyResult:
    batch, width = draft_token_ids.shape
    positions = torch.arange(width, device=draft_token_ids.device)
    is_draft = positions[None, :] < num_draft[:, None]  # [B, K]
    target_argmax = target_logits.argmax(dim=-1)  # [B, K+1]

    greedy_accept = (draft_token_ids == target_argmax[:, :width]) & is_draft
    num_accepted = greedy_accept.int().cumprod(dim=-1).sum(dim=-1)  # [B]
    output = target_argmax.clone()
    if not sampling.all_greedy:
        sampled_output, sampled_accepted = _speculative_sampling(
            draft_token_ids, is_draft, num_draft, target_logits, draft_probs, sampling, draft_rate, draft_skipped)
        output = torch.where(sampling.greedy[:, None], output, sampled_output)
        num_accepted = torch.where(sampling.greedy, num_accepted, sampled_accepted)
    emitted = torch.arange(width + 1, device=output.device)[None, :] <= num_accepted[:, None]
    return VerifyResult(output.masked_fill(~emitted, -1), num_accepted)


def _speculative_sampling(draft_token_ids, is_draft, num_draft, target_logits, draft_probs, sampling,
                          draft_rate=None, draft_skipped=None):
    batch, width = draft_token_ids.shape
    vocab = target_logits.shape[-1]
    per_position = sampling.repeat(width + 1)
    target_probs = sampling_probs(target_logits.flatten(0, 1), per_position).view(batch, width + 1, vocab)
    if draft_probs is None:
        draft_probs = F.one_hot(draft_token_ids.clamp(min=0), vocab).to(target_probs.dtype)  # point masses
    elif draft_probs.shape[-1] < vocab:  # a draft vocabulary that only lacks padding at the end
        draft_probs = F.pad(draft_probs, (0, vocab - draft_probs.shape[-1]))

    index = draft_token_ids.clamp(min=0)[..., None]
    p_draft = target_probs[:, :width].gather(-1, index).squeeze(-1)  # p_i(x_i)  [B, K]
    q_draft = draft_probs.gather(-1, index).squeeze(-1)  # q_i(x_i)  [B, K]
    uniform = _uniform(batch, width, sampling.generators, target_probs.device)  # [B, K]
    rate = torch.ones(batch, width, dtype=q_draft.dtype, device=q_draft.device)  # [B, K]: a at position 1
    if draft_rate is not None and width:
        rate[:, 0] = draft_rate
    accept = (uniform * rate * q_draft <= p_draft) & is_draft  # u <= p/(a q) without dividing
    if draft_skipped is not None and width:
        accept[:, 0] &= ~draft_skipped
    num_accepted = accept.int().cumprod(dim=-1).sum(dim=-1)  # [B]

    # The last emitted token: recovered (from the residual) where a draft was rejected, else bonus.
    rows = torch.arange(batch, device=target_probs.device)
    last = num_accepted.clamp(max=width)
    p_last = target_probs[rows, last]  # [B, V]
    last_draft = last.clamp(max=max(width - 1, 0))
    q_last = draft_probs[rows, last_draft] * rate[rows, last_draft][:, None] if width else torch.zeros_like(p_last)
    rejected = (num_accepted < num_draft)[:, None]
    final_probs = torch.where(rejected, residual_probs(p_last, q_last), p_last)
    final_token = sample_from_probs(final_probs, sampling.generators)  # [B]

    output = torch.cat([draft_token_ids, draft_token_ids.new_zeros(batch, 1)], dim=1)  # [B, K+1]
    output[rows, last] = final_token
    return output, num_accepted


def _uniform(batch: int, width: int, generators, device) -> torch.Tensor:
    if all(g is None for g in generators):
        return torch.rand(batch, width, device=device)
    return torch.stack([torch.rand(width, generator=g, device=device) for g in generators]) if batch else \
        torch.empty(0, width, device=device)
