"""What one engine step measured: the target pass (its tokens over all rows and its seconds) and
each drafter's call (the tokens it drafted per row and its seconds). The engine feeds these to its
adaptive drafters' live costs (`speculative.control.live_costs`) and to anyone listening (the
planner calibrates its simulation with them); it also counts decoding steps and those that drafted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MAX_PENDING_RATIOS = 1024  # predicted / observed step times kept until metrics collect them


@dataclass(slots=True)
class DraftCall:
    num_tokens: list[int]  # [rows of the drafter]: tokens asked of it per row
    seconds: float
    lags: list[int]  # [rows]: tokens each row's drafter had to absorb first (1: just the newest)


@dataclass(slots=True)
class StepTiming:
    is_prefill: bool
    num_tokens: int  # tokens the target pass computed (`ModelRunner.pass_tokens`: padded rows included)
    target_seconds: float  # the pass, the sampler and verification (one host sync)
    drafts: dict[str, DraftCall] = field(default_factory=dict)  # method -> its call this step


@dataclass(slots=True)
class StepCounters:
    decode_steps: int = 0
    drafting_steps: int = 0  # decoding steps in which some row carried a draft
    constrained_steps: int = 0  # steps (prefills included) with a row under a grammar
    grammar_seconds: float = 0.0  # their structured-outputs work on the engine's thread, masks waited for
    predicted_over_observed: deque = field(default_factory=lambda: deque(maxlen=MAX_PENDING_RATIOS))

    def drain_ratios(self) -> list[float]:
        ratios = list(self.predicted_over_observed)
        self.predicted_over_observed.clear()
        return ratios
