"""Turn logits into tokens: temperature, top-k and top-p, then greedy or seeded sampling.

Everything is vectorised over rows and stays on the device: no host sync inside.
`warp_logits` is the single definition of a request's sampling distribution; speculative
verification applies the same function to target and draft logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftwise.sampling.params import SamplingParams


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling settings as tensors on the logits' device."""

    temperature: torch.Tensor  # [N] (1.0 where greedy, so division is harmless)
    top_k: torch.Tensor  # [N] (vocab size where disabled)
    top_p: torch.Tensor  # [N]
    greedy: torch.Tensor  # [N] bool
    needs_sort: bool  # any row cuts by top-k or top-p
    all_greedy: bool
    generators: list[torch.Generator | None]  # per row: seeded generator, or None for the global RNG

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator | None],
              vocab_size: int, device: torch.device) -> "SamplingBatch":
        return cls(
            temperature=torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                                     dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            greedy=torch.tensor([p.greedy for p in params], device=device),
            needs_sort=any(p.top_k > 0 or p.top_p < 1 for p in params),
            all_greedy=all(p.greedy for p in params),
            generators=generators,
        )

    def repeat(self, times: int) -> "SamplingBatch":
        """Each row repeated `times` times in place (row 0, row 0, ..., row 1, ...): one per position."""
        return SamplingBatch(
            self.temperature.repeat_interleave(times), self.top_k.repeat_interleave(times),
            self.top_p.repeat_interleave(times), self.greedy.repeat_interleave(times),
            self.needs_sort, self.all_greedy, [g for g in self.generators for _ in range(times)],
        )


def warp_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p to logits [N, V]; cut tokens become -inf."""
    logits = logits.float() / batch.temperature[:, None]
    if not batch.needs_sort:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    cut = ranks[None, :] >= batch.top_k[:, None]  # top-k
    sorted_probs = sorted_logits.masked_fill(cut, float("-inf")).softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    cut |= mass_before >= batch.top_p[:, None]  # top-p: keep the smallest prefix reaching top_p
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each row samples from: probs [N, V]."""
    return warp_logits(logits, batch).softmax(dim=-1)


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs [N, V]: argmax(probs / E) with E ~ Exponential(1), i.e. a draw
    from probs (the exponential race), with each row's noise from its own generator."""
    noise = torch.empty_like(probs)
    if all(g is None for g in generators):
        noise.exponential_()
    else:
        for row, generator in enumerate(generators):
            noise[row].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Token ids [N] for logits [N, V]."""
    greedy_ids = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_ids
    sampled_ids = sample_from_probs(sampling_probs(logits, batch), batch.generators)
    return torch.where(batch.greedy, greedy_ids, sampled_ids)
