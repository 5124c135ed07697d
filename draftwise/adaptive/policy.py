"""How the engine asks how many tokens to draft for a request: a fixed k, or the goodput controller."""

from __future__ import annotations

from collections import deque
from typing import Protocol

from draftwise.adaptive.controller import AcceptanceEstimate, GoodputController
from draftwise.adaptive.cost_model import CostModel
from draftwise.engine.sequence import Sequence

MAX_LENGTHS_KEPT = 256
MIN_LENGTHS = 4


class DraftLengthPolicy(Protocol):
    def num_tokens(self, seq: Sequence, lag: int) -> int:
        """Tokens to draft for `seq` this step (0: a plain step); lag: the drafter's backlog."""

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """What the verification of this step's draft gave."""

    def release(self, seq: Sequence) -> None:
        """The request has finished."""


class FixedLength:
    def __init__(self, num_tokens: int) -> None:
        self.k = num_tokens

    def num_tokens(self, seq: Sequence, lag: int) -> int:
        return self.k

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass


class AdaptiveLength:
    """A `GoodputController` per request, each starting from what earlier requests taught: the
    drafter's acceptance estimate, its probing back-off, and how long requests run."""

    def __init__(self, costs: CostModel, max_tokens: int, probe_interval: int = 8) -> None:
        self.costs = costs
        self.max_tokens = max_tokens
        self.probe_interval = probe_interval
        self.shared = AcceptanceEstimate.prior(max_tokens)  # the drafter's running estimate
        self.shared_interval: int | None = None  # and its probing back-off (None: the controller's first)
        self.finished_lengths: deque[int] = deque(maxlen=MAX_LENGTHS_KEPT)  # tokens emitted by finished requests
        self._controllers: dict[str, GoodputController] = {}

    def expected_tokens_left(self, generated: int) -> float | None:
        """Mean of L - generated over the finished requests that ran longer than `generated`
        (None while fewer than MIN_LENGTHS did: then the controller falls back to ski rental)."""
        longer = [length - generated for length in self.finished_lengths if length > generated]
        return sum(longer) / len(longer) if len(longer) >= MIN_LENGTHS else None

    def controller(self, seq: Sequence) -> GoodputController:
        if seq.request_id not in self._controllers:
            # A seeded request starts from the prior, not from what other requests taught: its k
            # choices (and so how it draws its random numbers) then depend on itself alone, and the
            # same seed gives the same output on the same machine.
            seeded = seq.params.seed is not None
            start = AcceptanceEstimate.prior(self.max_tokens) if seeded else self.shared.copy()
            self._controllers[seq.request_id] = GoodputController(
                self.costs, self.max_tokens, start, self.probe_interval,
                start_interval=None if seeded else self.shared_interval)
        return self._controllers[seq.request_id]

    def num_tokens(self, seq: Sequence, lag: int) -> int:
        generated = len(seq.output_ids)
        # A seeded request decides from itself alone (see `controller`).
        expected = None if seq.params.seed is not None else self.expected_tokens_left(generated)
        return self.controller(seq).choose(lag, seq.num_tokens_left, generated, expected)

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        controller = self.controller(seq)
        controller.observe(num_drafted, num_accepted)
        self.shared.observe(num_drafted, num_accepted)
        if seq.params.seed is None:
            self.shared_interval = controller.interval

    def release(self, seq: Sequence) -> None:
        if self._controllers.pop(seq.request_id, None) is not None:
            self.finished_lengths.append(len(seq.output_ids))
