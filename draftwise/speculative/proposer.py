"""The one interface every drafter implements; the engine never asks which drafter it has."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from draftwise.speculative.sequence import SequenceState


@dataclass(slots=True)
class Draft:
    token_ids: list[int]  # [k] proposed continuation (may be shorter than asked, or empty)
    probs: torch.Tensor | None = None  # [k, V] the drafter's (warped) distribution per position; None: deterministic


@dataclass(frozen=True, slots=True)
class Footprint:
    """Memory a drafter adds to the target's: its own weights, and KV cache per token it holds."""

    weights_bytes: int = 0
    kv_bytes_per_token: int = 0


class Proposer(Protocol):
    # The most backlog a first draft absorbs (a draft model's context window; None: unbounded, or
    # no cache at all). The planner's simulator charges catch-ups with it.
    catch_up_window: int | None

    def propose(self, seqs: list[SequenceState], num_tokens: list[int]) -> list[Draft]:
        """Up to num_tokens[b] tokens continuing seqs[b] (all of its committed tokens)."""

    def on_verified(self, seqs: list[SequenceState], num_accepted: list[int]) -> None:
        """Called after the target committed tokens: roll own state back to what was kept, learn."""

    def release(self, seq: SequenceState) -> None:
        """The sequence has finished (or its state must be rebuilt): free anything held for it."""

    def lag(self, seq: SequenceState) -> int:
        """Committed tokens the drafter has yet to absorb before it can draft for `seq` (its own
        cache's backlog: the whole prompt before the first draft; 0 for drafters without a cache)."""

    def footprint(self) -> Footprint:
        """The memory this drafter adds (the planner reports it)."""


class CachelessProposer:
    """What a drafter without state of its own per request needs of the protocol: nothing to roll
    back, release or catch up on, and no memory beyond the target's (prompt lookup, layer skip)."""

    catch_up_window = None

    def on_verified(self, seqs: list[SequenceState], num_accepted: list[int]) -> None:
        pass

    def release(self, seq: SequenceState) -> None:
        pass

    def lag(self, seq: SequenceState) -> int:
        return 0

    def footprint(self) -> Footprint:
        return Footprint()
