"""How the engine asks how many tokens to draft for a request: a fixed k, or the goodput controller."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from draftwise.speculative.control.controller import AcceptanceEstimate, GoodputController, expected_tokens
from draftwise.speculative.control.cost_model import CostModel
from draftwise.speculative.sequence import SequenceState

MAX_LENGTHS_KEPT = 256
MIN_LENGTHS = 4
MAX_SEGMENTS = 32  # traffic segments remembered (by the controller, and labelled in the server's metrics)


class DraftLengthPolicy(Protocol):
    def num_tokens(self, seqs: list[SequenceState], lags: list[int], batch_size: int | None = None) -> list[int]:
        """Tokens to draft for each row of this step's batch (0: a plain step for that row);
        lags: the drafter's backlog per row; batch_size: the step's rows, other drafters' and
        plain ones included (None: just `seqs`)."""

    def observe(self, seq: SequenceState, num_drafted: int, num_accepted: int) -> None:
        """What the verification of this step's draft gave."""

    def release(self, seq: SequenceState) -> None:
        """The request has finished."""


class FixedLength:
    def __init__(self, num_tokens: int) -> None:
        self.k = num_tokens

    def num_tokens(self, seqs: list[SequenceState], lags: list[int], batch_size: int | None = None) -> list[int]:
        return [self.k] * len(seqs)

    def observe(self, seq: SequenceState, num_drafted: int, num_accepted: int) -> None:
        pass

    def release(self, seq: SequenceState) -> None:
        pass


@dataclass(slots=True)
class TrafficMemory:
    """What a drafter learnt from the requests of one kind of traffic: its acceptance estimate,
    its probing back-off, and how long requests ran."""

    estimate: AcceptanceEstimate
    interval: int | None = None  # the probing back-off reached (None: the controller's first)
    lengths: deque = field(default_factory=lambda: deque(maxlen=MAX_LENGTHS_KEPT))  # tokens of finished requests

    def expected_tokens_left(self, generated: int) -> float | None:
        """Mean of L - generated over the finished requests that ran longer than `generated`
        (None while fewer than MIN_LENGTHS did: then the controller falls back to ski rental)."""
        longer = [length - generated for length in self.lengths if length > generated]
        return sum(longer) / len(longer) if len(longer) >= MIN_LENGTHS else None


class AdaptiveLength:
    """A `GoodputController` per request, each starting from what earlier requests taught.

    Traffic differs: translations end after ~20 tokens, code runs on; a draft model's catch-up pays
    on one and not the other, and acceptance differs too. Requests may carry a traffic `segment`
    (a label); each segment keeps its own memory (the first MAX_SEGMENTS labels; later ones, and
    requests without a label, share the drafter's overall memory, which every request also feeds).
    A new segment starts from the optimistic prior, as the drafter's first request did: the overall
    estimate is what other traffic taught, and a low one (a drafter bad at summaries) would keep a
    new segment plain, where nothing is learnt (the benchmark's last segment, code, where the draft
    model is accepted 88% of the time, inherited 0.29 from the others and never drafted)."""

    def __init__(self, costs: CostModel, max_tokens: int, probe_interval: int = 8) -> None:
        self.costs = costs
        self.max_tokens = max_tokens
        self.probe_interval = probe_interval
        self.overall = TrafficMemory(AcceptanceEstimate.prior(max_tokens))
        self.segments: dict[str, TrafficMemory] = {}
        self._controllers: dict[str, GoodputController] = {}

    def memory(self, seq: SequenceState) -> TrafficMemory:
        segment = getattr(seq, "segment", None)
        if segment is None:
            return self.overall
        if segment not in self.segments:
            if len(self.segments) >= MAX_SEGMENTS:
                return self.overall
            self.segments[segment] = TrafficMemory(AcceptanceEstimate.prior(self.max_tokens))
        return self.segments[segment]

    def controller(self, seq: SequenceState) -> GoodputController:
        if seq.request_id not in self._controllers:
            memory = self.memory(seq)
            self._controllers[seq.request_id] = GoodputController(
                self.costs, self.max_tokens, memory.estimate.copy(), self.probe_interval, start_interval=memory.interval)
        return self._controllers[seq.request_id]

    def num_tokens(self, seqs: list[SequenceState], lags: list[int], batch_size: int | None = None) -> list[int]:
        rows = batch_size or len(seqs)
        choices = [self._solo(seq, lag, rows) for seq, lag in zip(seqs, lags)]
        return self._fit_to_batch(seqs, choices, rows) if rows > 1 and any(choices) else choices

    def _solo(self, seq: SequenceState, lag: int, batch_rows: int) -> int:
        """The row's own choice; a catch-up must pay for every row of the batch that waits for it."""
        generated = len(seq.output_ids)
        expected = self.expected_tokens_left(seq, generated)
        return self.controller(seq).choose(lag, seq.num_tokens_left, generated, expected, batch_rows)

    def expected_tokens_left(self, seq: SequenceState, generated: int) -> float | None:
        """From the lengths of the request's segment, else of all traffic (a segment's first
        requests: lengths, unlike acceptance, say more across kinds of traffic than nothing does,
        and without them a draft model rents plain steps before every catch-up), else None."""
        memory = self.memory(seq)
        expected = memory.expected_tokens_left(generated)
        if expected is None and memory is not self.overall:
            expected = self.overall.expected_tokens_left(generated)
        return expected

    def _fit_to_batch(self, seqs: list[SequenceState], choices: list[int], batch_rows: int) -> list[int]:
        """Each row's own choice assumed a step of its own; in a batch every drafted token adds
        to one shared verification pass, whose cost grows with the batch. Cap every row's k at a
        common c (c = 0: the whole batch takes a plain step), choosing c for the best batch
        goodput sum_b E_b(min(k_b, c)) / C(min(k_1, c), ..., min(k_B, c)). Rows whose solo choice
        was 0 stay plain, so drafting and plain rows mix in one step. (No row's output depends on
        its k: greedy and seeded rows emit what plain decoding emits, unseeded ones follow the
        target's distribution whatever k is.) The step's other rows (plain ones, other drafters')
        count as plain rows: each commits one token and feeds one (padded to the drafting rows'
        width where the runner pads: `CostModel.pass_seconds`)."""
        rates = [self.controller(seq).estimate.effective_rates() for seq in seqs]
        others = max(0, batch_rows - len(seqs))
        best, best_goodput = choices, -1.0
        for cap in range(max(choices), -1, -1):
            capped = [min(k, cap) for k in choices]
            goodput = (sum(expected_tokens(r, k) for r, k in zip(rates, capped)) + others) \
                / self.costs.batch_step_seconds(capped + [0] * others)
            if goodput > best_goodput * (1 + 1e-9):
                best, best_goodput = capped, goodput
        return best

    def observe(self, seq: SequenceState, num_drafted: int, num_accepted: int) -> None:
        controller = self.controller(seq)
        controller.observe(num_drafted, num_accepted)
        for memory in self._memories(seq):
            memory.estimate.observe(num_drafted, num_accepted)
            memory.interval = controller.interval

    def release(self, seq: SequenceState) -> None:
        if self._controllers.pop(seq.request_id, None) is not None and seq.finish_reason in ("stop", "length"):
            for memory in self._memories(seq):  # (an aborted or failed request says nothing of answers' lengths)
                memory.lengths.append(len(seq.output_ids))

    def _memories(self, seq: SequenceState) -> list[TrafficMemory]:
        memory = self.memory(seq)
        return [memory] if memory is self.overall else [memory, self.overall]
