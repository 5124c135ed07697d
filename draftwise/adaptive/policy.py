"""How the engine asks how many tokens to draft for a request: a fixed k, or the goodput controller."""

from __future__ import annotations

from typing import Protocol

from draftwise.adaptive.controller import AcceptanceEstimate, GoodputController
from draftwise.adaptive.cost_model import CostModel
from draftwise.engine.sequence import Sequence


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
    """A `GoodputController` per request, each starting from what earlier requests taught."""

    def __init__(self, costs: CostModel, max_tokens: int, probe_interval: int = 8) -> None:
        self.costs = costs
        self.max_tokens = max_tokens
        self.probe_interval = probe_interval
        self.shared = AcceptanceEstimate.prior(max_tokens)  # the drafter's running estimate
        self.shared_interval = probe_interval  # and its probing back-off
        self._controllers: dict[str, GoodputController] = {}

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
        return self.controller(seq).choose(lag, seq.num_tokens_left, len(seq.output_ids))

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        controller = self.controller(seq)
        controller.observe(num_drafted, num_accepted)
        self.shared.observe(num_drafted, num_accepted)
        if seq.params.seed is None:
            self.shared_interval = controller.interval

    def release(self, seq: Sequence) -> None:
        self._controllers.pop(seq.request_id, None)
