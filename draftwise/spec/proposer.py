"""The one interface every drafter implements; the engine never asks which drafter it has."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from draftwise.engine.sequence import Sequence


@dataclass(slots=True)
class Draft:
    token_ids: list[int]  # [k] proposed continuation (may be shorter than asked, or empty)
    probs: torch.Tensor | None = None  # [k, V] the drafter's (warped) distribution per position; None: deterministic


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        """Up to num_tokens[b] tokens continuing seqs[b] (all of its committed tokens)."""

    def on_verified(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        """Called after the target committed tokens: roll own state back to what was kept, learn."""

    def release(self, seq: Sequence) -> None:
        """The sequence has finished: free anything held for it."""

    def lag(self, seq: Sequence) -> int:
        """Committed tokens the drafter has yet to absorb before it can draft for `seq` (its own
        cache's backlog: the whole prompt before the first draft; 0 for drafters without a cache)."""
