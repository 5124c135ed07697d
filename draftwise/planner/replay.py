"""Acceptance replayed where it happened: each sampled request's drafts, position by position.

Why: per-position rates drawn independently each step lose what a drafter's acceptance looks like
in a request. Prompt lookup copies a stretch or finds nothing; a draft model agrees for a
sentence, then not. The engine's controller rides those stretches (k grows inside one, drops
outside), so i.i.d. draws made adaptive speculation look 8-18% slower than it measured on held-out
traffic. With greedy decoding the output is the plain run's, whatever k is, so what a drafter
would have had accepted at output position p is a property of the request: `matches[p]`, the
length of the accepted run of a draft made at p (-1: the drafter proposes nothing there). A step
drafting k tokens at p then commits min(k, matches[p]) + 1.

It is measured from one run at a fixed k (`SpecMetrics.steps`: drafted and accepted per step).
A step at position p that drafted d tokens and had a < d accepted gives matches[p] = a, and the
positions it skipped p + j (j = 1..a) matches[p + j] = a - j: a draft made there would continue
the same run and miss at the same token (exactly so for a greedy draft model, whose chain from
p + j is the rest of its chain from p; nearly so for lookups). A step with all d accepted knows
only matches[p] >= d: the run is taken to go on through the bonus token into the next step's run
when that step drafted and had something accepted, and to end at d otherwise. Positions no step
visited or skipped (none, in a complete run) propose nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

NO_PROPOSAL = -1


@dataclass(frozen=True, slots=True)
class Replay:
    matches: tuple[tuple[int, ...], ...]  # [request][output position]: accepted run of a draft there, or -1

    def accepted(self, request: int, position: int, k: int) -> int | None:
        """Drafted tokens accepted if request `request` drafts k at output position `position`;
        None where its drafter proposes nothing (a plain row)."""
        trace = self.matches[request] if request < len(self.matches) else ()
        match = trace[position] if 0 <= position < len(trace) else NO_PROPOSAL
        return None if match == NO_PROPOSAL else min(k, match)


def match_lengths(steps: list[tuple[int, int]], num_output_tokens: int) -> tuple[int, ...]:
    """matches[p] for p in 0..num_output_tokens-1 from one request's steps (drafted, accepted),
    the first decode step at position 1 (the prefill emits token 0)."""
    visits, position = [], 1
    for drafted, accepted in steps:
        visits.append((position, drafted, accepted))
        position += accepted + 1
    matches = [NO_PROPOSAL] * num_output_tokens
    next_run = 0  # the run of the next visited step, 0 where it drafted nothing or had nothing accepted
    for position, drafted, accepted in reversed(visits):
        if drafted == 0:
            run = NO_PROPOSAL
        elif accepted < drafted:
            run = accepted
        else:
            run = drafted + (1 + next_run if next_run > 0 else 0)
        for j in range(accepted + 1):  # the position itself and those its accepted tokens skipped
            if position + j < num_output_tokens:
                matches[position + j] = NO_PROPOSAL if run == NO_PROPOSAL else run - j
        next_run = max(run, 0)
    return tuple(matches)
