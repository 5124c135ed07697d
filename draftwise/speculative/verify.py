"""Verification of drafted tokens against the target: a pure function over padded tensors.

Words (as in vLLM): *accepted* tokens are drafted tokens the target keeps; the *recovered* token
replaces the first rejected draft; the *bonus* token follows when every draft was accepted. A row
that accepts `a` of its k drafts emits a + 1 tokens.

Greedy rows accept while draft == argmax(target); the emitted tokens are then simply the target's
argmax at positions 0..a, which is what one-token-at-a-time greedy decoding would produce.

Seeded sampled rows are verified the same way, by equality, against the token the target itself
samples at each position: y_t = argmax_x p_t(x) / E_t(x), with E_t i.i.d. Exponential(1) noise
keyed by the request's seed and the output position t (`draftwise/sampling/noise.py`). That is a
draw from p_t (the exponential race: P(y_t = x) = p_t(x)), so every emitted token follows the
target's distribution; and since y_t depends only on the committed prefix, the seed and t, the
emitted sequence is exactly what plain seeded decoding emits, whatever was drafted, batched or
verified beside it. A drafter sharing the noise (a draft model drafts argmax q_t / E_t with the same
E_t) proposes y_t whenever the two races have the same winner (a Gumbel-max coupling of p_t and
q_t), so drafts still get accepted; a deterministic drafter is accepted with probability p_t(x_t),
as under rejection sampling.

Unseeded sampled rows use speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers
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

from draftwise.sampling.sampler import SamplingBatch, sample, sample_from_probs, sampling_probs


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
    sampling: SamplingBatch,  # one row per sequence, positions: the output position of each row's first logit
    draft_rate: torch.Tensor | None = None,  # [B] randomized drafting's a per row (1: off)
    draft_skipped: torch.Tensor | None = None,  # [B] bool: the coin said "plain step" (first token from R)
) -> VerifyResult:
    batch, width = draft_token_ids.shape
    positions = torch.arange(width, device=draft_token_ids.device)
    is_draft = positions[None, :] < num_draft[:, None]  # [B, K]

    # Greedy and seeded rows: the token the target emits at each position is fixed by the prefix
    # (and the seed); a drafted token is accepted iff it is that token.
    chosen = target_tokens(target_logits, sampling)  # [B, K+1]
    accepted = (draft_token_ids == chosen[:, :width]) & is_draft
    num_accepted = accepted.int().cumprod(dim=-1).sum(dim=-1)  # [B]
    output = chosen
    if sampling.any_unseeded_sampled:
        sampled_output, sampled_accepted = _speculative_sampling(
            draft_token_ids, is_draft, num_draft, target_logits, draft_probs, sampling, draft_rate, draft_skipped)
        by_rejection = ~(sampling.greedy | sampling.seeded)  # [B]
        output = torch.where(by_rejection[:, None], sampled_output, output)
        num_accepted = torch.where(by_rejection, sampled_accepted, num_accepted)
    emitted = torch.arange(width + 1, device=output.device)[None, :] <= num_accepted[:, None]
    return VerifyResult(output.masked_fill(~emitted, -1), num_accepted)


def target_tokens(target_logits: torch.Tensor, sampling: SamplingBatch) -> torch.Tensor:
    """[B, K+1]: the target's argmax for greedy rows, its keyed draw for seeded rows (anything for
    unseeded sampled rows: rejection sampling decides those)."""
    batch, width_plus_one, vocab = target_logits.shape
    chosen = target_logits.argmax(dim=-1)
    seeded_rows = [b for b, seed in enumerate(sampling.seeds) if seed is not None]
    if seeded_rows:
        rows = torch.tensor(seeded_rows, device=target_logits.device)
        per_position = sampling.select(seeded_rows).repeat(width_plus_one)
        draws = sample(target_logits[rows].flatten(0, 1), per_position)  # [S * (K+1)]
        chosen[rows] = draws.view(len(seeded_rows), width_plus_one)
    return chosen


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
    uniform = _uniform(batch, width, target_probs.device)  # [B, K]
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
    final_token = sample_from_probs(final_probs, None)  # [B] (only unseeded rows' are kept)

    output = torch.cat([draft_token_ids, draft_token_ids.new_zeros(batch, 1)], dim=1)  # [B, K+1]
    output[rows, last] = final_token
    return output, num_accepted


def _uniform(batch: int, width: int, device: torch.device) -> torch.Tensor:
    """[B, K] the acceptance tests' U(0, 1) draws (from the global generator: unseeded rows only)."""
    return torch.rand(batch, width, device=device)
