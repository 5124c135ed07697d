"""What the planner measures with the real engine: output lengths, what prefills cost, and
acceptance per segment (validation runs `draftwise.llm.closed_loop`).

Acceptance is measured with a fixed k (every step drafts k tokens, so every position is seen) and
turned into conditional rates: a_0 = accepted[0] / drafted[0], a_i = accepted[i] /
min(accepted[i-1], drafted[i]) (the drafts that reached position i with i-1 accepted), from the
per-position counters of `SpecMetrics`. Positions a
drafter rarely reaches keep the last well-measured rate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from draftwise.llm import LLM
from draftwise.planner.replay import Replay, match_lengths
from draftwise.planner.simulate import Acceptance, Request
from draftwise.traffic import TrafficItem
from draftwise.sampling.params import SamplingParams
from draftwise.speculative.metrics import SpecMetrics

MIN_OBSERVATIONS = 8  # a position seen fewer times keeps the previous position's rate


def plain_requests(llm: LLM, items: list[TrafficItem],
                   listener: Callable | None = None) -> tuple[list[Request], float, list[tuple[int, float]]]:
    """Run the sample with plain greedy decoding, one request at a time: each request's lengths,
    the seconds the run took and its timed prefills, (prompt tokens, seconds) (the planner
    calibrates its cost model with them). `listener` hears the run's step timings (not the warm-up's)."""
    llm.set_speculative(None, progress=False)
    llm.generate(items[0].prompt, SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    requests, seconds, prefills = [], 0.0, []
    with llm.listening(collecting_prefills(prefills, listener)):
        for item in items:
            output = llm.generate(item.prompt, SamplingParams(temperature=0.0, max_tokens=item.max_tokens))[0]
            requests.append(Request(len(output.prompt_token_ids), max(1, len(output.token_ids)), item.segment))
            seconds += output.metrics.seconds
    return requests, seconds, prefills


def collecting_prefills(prefills: list[tuple[int, float]], listener: Callable | None) -> Callable:
    """A step-timing listener that appends each prefill's (prompt tokens, seconds) to `prefills`
    and passes every timing on to `listener`."""
    def listen(timing) -> None:
        if timing.is_prefill:
            prefills.append((timing.num_tokens, timing.target_seconds))
        if listener is not None:
            listener(timing)
    return listen


@dataclass(frozen=True, slots=True)
class PrefillCost:
    """Seconds of a prefill over n prompt tokens: a line fitted (least squares) to the prefills timed
    while the sample ran plain. The cost model's passes stop at 64 tokens, and prefills of hundreds
    extrapolated from them fell short; the planner charged the difference to every decoding step
    (37 ms a step on held-out traffic), which made speculation's fewer steps look cheaper than they are."""
    fixed: float
    per_token: float

    def seconds(self, num_tokens: int) -> float:
        return self.fixed + self.per_token * num_tokens

    @staticmethod
    def fit(points: list[tuple[int, float]]) -> "PrefillCost | None":
        """From (prompt tokens, seconds); None without two distinct lengths."""
        if len({n for n, _ in points}) < 2:
            return None
        lengths, seconds = np.array(points, dtype=np.float64).T
        slope = max(float(np.polyfit(lengths, seconds, 1)[0]), 0.0)
        return PrefillCost(max(0.0, float(seconds.mean() - slope * lengths.mean())), slope)


def measure_acceptance(llm: LLM, items: list[TrafficItem], speculative: dict, k: int,
                       listener_after_install: Callable[[], Callable] | None = None,
                       prefills: list[tuple[int, float]] | None = None) -> tuple[dict[str, Acceptance], Replay]:
    """Per segment: the drafter's conditional acceptance rates at a fixed k (and how often it
    proposes); and per request, what its drafts would have had accepted at each output position
    (`replay.py`). `listener_after_install`, called once the drafter is installed, returns a
    listener for the runs' step timings; `prefills` collects the run's timed prefills."""
    llm.set_speculative({**speculative, "num_speculative_tokens": k, "adaptive": False}, progress=False)
    listener = listener_after_install() if listener_after_install is not None else None
    by_segment: dict[str, SpecMetrics] = {}
    matches = []
    with llm.listening(collecting_prefills(prefills if prefills is not None else [], listener)):
        for item in items:
            output = llm.generate(item.prompt, SamplingParams(temperature=0.0, max_tokens=item.max_tokens),
                                  segment=item.segment or None)[0]
            spec = output.metrics.spec
            if spec is not None:
                by_segment.setdefault(item.segment, SpecMetrics()).merge(spec)
            matches.append(match_lengths(spec.steps if spec is not None else [], len(output.token_ids)))
    return {segment: acceptance_from(metrics) for segment, metrics in by_segment.items()}, Replay(tuple(matches))


def acceptance_from(metrics: SpecMetrics) -> Acceptance:
    rates: list[float] = []
    previous_accepted = None
    for accepted, drafted in zip(metrics.accepted_per_position, metrics.drafted_per_position):
        # drafts that reached this position with the previous one accepted (short drafts, cut by the
        # tokens a request had left, never reach it)
        reached = drafted if previous_accepted is None else min(previous_accepted, drafted)
        if reached < MIN_OBSERVATIONS and rates:
            rates.append(rates[-1])
        else:
            rates.append(min(1.0, accepted / reached) if reached else 0.0)
        previous_accepted = accepted
    steps = metrics.num_drafts + metrics.num_plain_steps
    return Acceptance(tuple(rates), metrics.num_drafts / steps if steps else 0.0)
