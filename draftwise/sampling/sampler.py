"""Turn logits into tokens: temperature, top-k and top-p, then greedy or sampled (seeded or not).

Everything is vectorised over rows and stays on the device: no host sync inside.
`warp_logits` is the single definition of a request's sampling distribution; speculative
verification applies the same function to target and draft logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftwise.sampling.noise import exponential_noise
from draftwise.sampling.params import SamplingParams


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling settings as tensors on the logits' device, and where each row's noise comes
    from: a seeded row's from its seed and the output position its logits predict (`noise.py`),
    an unseeded row's from the global generator."""

    temperature: torch.Tensor  # [N] (1.0 where greedy, so division is harmless)
    top_k: torch.Tensor  # [N] (vocab size where disabled)
    top_p: torch.Tensor  # [N]
    min_p: torch.Tensor  # [N] (0: off)
    greedy: torch.Tensor  # [N] bool
    seeded: torch.Tensor  # [N] bool: sampled rows with a seed
    needs_sort: bool  # any row cuts by top-k or top-p
    needs_min_p: bool  # any row cuts by min-p
    all_greedy: bool
    any_unseeded_sampled: bool  # any row samples from the global generator (rejection sampling verifies it)
    seeds: list[int | None]  # [N] each row's seed (None: the global generator)
    positions: list[int]  # [N] the output position (0 = first generated token) each row's logits predict

    @classmethod
    def build(cls, params: list[SamplingParams], positions: list[int], vocab_size: int,
              device: torch.device) -> "SamplingBatch":
        seeds = [None if p.greedy else p.seed for p in params]
        return cls(
            temperature=torch.tensor([1.0 if p.greedy else p.temperature for p in params],
                                     dtype=torch.float32, device=device),
            top_k=torch.tensor([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params],
                               device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            greedy=torch.tensor([p.greedy for p in params], dtype=torch.bool, device=device),
            seeded=torch.tensor([seed is not None for seed in seeds], dtype=torch.bool, device=device),
            needs_sort=any(p.top_k > 0 or p.top_p < 1 for p in params),
            needs_min_p=any(p.min_p > 0 for p in params),
            all_greedy=all(p.greedy for p in params),
            any_unseeded_sampled=any(not p.greedy and p.seed is None for p in params),
            seeds=seeds,
            positions=list(positions),
        )

    @property
    def any_seeded(self) -> bool:
        return any(seed is not None for seed in self.seeds)

    def select(self, rows: list[int]) -> "SamplingBatch":
        """The batch of just these rows, in this order."""
        index = torch.tensor(rows, dtype=torch.long, device=self.temperature.device)
        seeds = [self.seeds[row] for row in rows]
        greedy = self.greedy[index]  # (the flags below stay the whole batch's: safe, if less tight)
        return SamplingBatch(self.temperature[index], self.top_k[index], self.top_p[index], self.min_p[index], greedy,
                             self.seeded[index], self.needs_sort, self.needs_min_p, self.all_greedy,
                             self.any_unseeded_sampled, seeds, [self.positions[row] for row in rows])

    def repeat(self, times: int) -> "SamplingBatch":
        """Each row repeated `times` times in place (row 0, row 0, ..., row 1, ...): one per position,
        predicting positions p, p + 1, ..., p + times - 1."""
        return SamplingBatch(
            self.temperature.repeat_interleave(times), self.top_k.repeat_interleave(times),
            self.top_p.repeat_interleave(times), self.min_p.repeat_interleave(times),
            self.greedy.repeat_interleave(times),
            self.seeded.repeat_interleave(times), self.needs_sort, self.needs_min_p, self.all_greedy,
            self.any_unseeded_sampled,
            [seed for seed in self.seeds for _ in range(times)],
            [position + i for position in self.positions for i in range(times)],
        )


def warp_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Apply temperature, then min-p, then top-k, then top-p to logits [N, V] (vLLM's order); cut
    tokens become -inf."""
    # (a huge logit, say one a tiny repetition_penalty divided, stays finite: +inf would make NaNs)
    logits = (logits.float() / batch.temperature[:, None]).clamp(max=torch.finfo(torch.float32).max)
    if batch.needs_min_p:
        # p(x) < min_p max p  <=>  logit(x) < max logit + log(min_p)
        floor = logits.max(dim=-1, keepdim=True).values + torch.log(batch.min_p[:, None])
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if not batch.needs_sort:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    cut = ranks[None, :] >= batch.top_k[:, None]  # top-k
    sorted_probs = sorted_logits.masked_fill(cut, float("-inf")).softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # top-p: keep the smallest prefix reaching top_p, at least the most likely token; a row at top_p 1
    # sorted for another row's sake cuts nothing (float32 sums short of 1 would cut its tail)
    cut |= (mass_before >= batch.top_p[:, None]) & (batch.top_p[:, None] < 1) & (ranks[None, :] > 0)
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each row samples from: probs [N, V]."""
    return warp_logits(logits, batch).softmax(dim=-1)


def sample_from_probs(probs: torch.Tensor, batch: SamplingBatch | None) -> torch.Tensor:
    """One token per row of probs [N, V]: argmax(probs / E) with E ~ Exponential(1) i.i.d., i.e. a
    draw from probs (the exponential race); a seeded row's E is keyed by its seed and position
    (batch None: every row's from the global generator)."""
    noise = torch.empty_like(probs)
    if batch is None or not batch.any_seeded:
        noise.exponential_()
    else:
        for row, (seed, position) in enumerate(zip(batch.seeds, batch.positions)):
            if seed is None:
                noise[row].exponential_()
            else:
                noise[row] = exponential_noise(seed, position, probs.shape[-1], probs.device)
    return (probs / noise).argmax(dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Token ids [N] for logits [N, V]: the argmax for greedy rows, a draw for the others."""
    greedy_ids = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_ids
    sampled_ids = sample_from_probs(sampling_probs(logits, batch), batch)
    return torch.where(batch.greedy, greedy_ids, sampled_ids)
