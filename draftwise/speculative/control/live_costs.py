"""Costs learned while serving: the cached profile is the prior, the steps the engine times are the
evidence.

A profile is measured once per machine and configuration; the machine's load is not. Every step
already knows how many tokens its target pass took (n, over all rows) and how long that took, and
how long its drafter took to propose. Each observation becomes a ratio to the prior at the same
point, observed / prior(n), and the live cost is

    live(n) = prior(n) x median of the last WINDOW ratios seen at n        (>= MIN_SAMPLES of them)
            = prior(n) x median of the last WINDOW ratios at any n          (otherwise, once enough)
            = prior(n)                                                      (before any evidence)

then made non-decreasing in n (a pass over more tokens never costs less; noise can say otherwise).
Medians of a sliding window are robust to the outliers of a busy machine (one descheduled step
does not move them) and follow a lasting change within WINDOW / 2 steps. The drafter's time is
tracked the same way, as one ratio to the prior's prediction for the call (its rows and k), over a
shorter window: once it is dear the controller drafts only probes, and those alone must show it
cheap again. A call that absorbed a backlog (a draft model reading a prompt before its first draft)
teaches the catch-up instead: what it took beyond the live drafting time, per backlog token, as a
ratio to the prior's; one such call is a long, steady measurement (hundreds of milliseconds), so the
median of the last few stands from the first. The profile times a catch-up on a warm machine and a
fixed context, and on the held-out translations the real ones took 1.1-1.3x its figure: enough to
make the controller buy a catch-up that a 20-token answer never earned back.

The live table is what the controller plans with (`CostModel`'s interface, so nothing else
changes). When the live plain step sits far from the prior's (PRIOR_FAR either way, over WINDOW
observations, their fast end compared), the prior was measured under other conditions (a busy
machine, another load): the cached file is dropped so that the next start measures afresh, and
the live costs carry on meanwhile.
"""

from __future__ import annotations

import bisect
import logging
import statistics
from collections import deque
from pathlib import Path

from draftwise.speculative.control.cost_model import CostModel

logger = logging.getLogger(__name__)

WINDOW = 16  # ratios kept per point (and overall)
DRAFT_WINDOW = 8  # the drafter's ratios kept: while it is dear only probes time it, so it must turn quickly
MIN_SAMPLES = 3  # ratios a point needs before its own median is used
MAX_LAG_OBSERVED = 2  # a drafter's call is timed if no row absorbed more (the newest token and one draft)
PRIOR_FAR = 1.5  # the live plain step this far from the prior's (either way): the prior is dropped


class Ratios:
    """Observed / prior ratios: the last `window` of them, or all of them (window None: the planner's
    whole run, kept in order as they come so that a median costs nothing at any length; a median
    of a growing run re-sorted at every step made a long run's steps ever dearer)."""

    def __init__(self, window: int | None) -> None:
        self.window = window
        self._recent: deque = deque(maxlen=window)
        self._ordered: list[float] = []

    def append(self, ratio: float) -> None:
        if self.window is None:
            bisect.insort(self._ordered, ratio)
        else:
            self._recent.append(ratio)

    def __len__(self) -> int:
        return len(self._recent) + len(self._ordered)

    def __bool__(self) -> bool:
        return len(self) > 0

    def median(self) -> float:
        if self.window is not None:
            return statistics.median(self._recent)
        middle = len(self._ordered) // 2
        return self._ordered[middle] if len(self._ordered) % 2 else (self._ordered[middle - 1] + self._ordered[middle]) / 2

    def lower_quartile(self) -> float:
        ordered = self._ordered if self.window is None else sorted(self._recent)
        return ordered[len(ordered) // 4]


class LiveCostModel(CostModel):
    """A `CostModel` whose tables move with what the engine measures (the prior's own tables are kept)."""

    def __init__(self, prior: CostModel, prior_path: Path | None = None, whole_run: bool = False) -> None:
        """whole_run: keep every ratio instead of the recent ones (the planner's view: what passes
        cost over a whole measured run, whose requests ran at many context lengths, rather than
        what they cost in its last WINDOW steps)."""
        super().__init__(dict(prior.target), dict(prior.draft), prior.catch_up, prior.key, prior.spread, prior.rows_padded)
        self.prior = prior
        self.prior_path = prior_path  # the cached profile, dropped if the evidence contradicts it
        self.prior_dropped = False
        self._window = None if whole_run else WINDOW
        self._target_ratios: dict[int, Ratios] = {}  # n -> recent observed / prior ratios
        self._all_target_ratios = Ratios(self._window)
        self._draft_ratios = Ratios(None if whole_run else DRAFT_WINDOW)
        self._catch_up_ratios = Ratios(None if whole_run else DRAFT_WINDOW)

    # --- evidence -----------------------------------------------------------------------------
    def observe_target(self, num_tokens: int, seconds: float) -> None:
        """A target pass over `num_tokens` new tokens (all rows) took `seconds`."""
        if num_tokens < 1 or seconds <= 0 or num_tokens > max(self.prior.target):
            return  # prefills past the profiled range say nothing about decoding steps
        ratio = seconds / self.prior.target_seconds(num_tokens)
        self._target_ratios.setdefault(num_tokens, Ratios(self._window)).append(ratio)
        self._all_target_ratios.append(ratio)
        self._refit_target()
        self._check_prior()

    def call_seconds(self, num_draft_tokens: list[int], lags: list[int]) -> float:
        """A drafter's call drafting num_draft_tokens[b] for row b after absorbing lags[b] tokens."""
        return self.batch_draft_seconds(num_draft_tokens) + sum(self.catch_up_seconds(lag) for lag in lags)

    def observe_draft(self, num_draft_tokens: list[int], seconds: float, lags: list[int] | None = None) -> None:
        """A drafter's call proposing num_draft_tokens[b] tokens for each of its rows (after absorbing
        lags[b] tokens: 1 is just the newest) took `seconds`. A call that absorbed more than
        MAX_LAG_OBSERVED tokens in some row is mostly catch-up: it teaches the catch-up cost."""
        lags = lags or [1] * len(num_draft_tokens)
        if seconds <= 0:
            return
        if max(lags) > MAX_LAG_OBSERVED:
            self._observe_catch_up(num_draft_tokens, seconds, lags)
            return
        predicted = self.prior.batch_draft_seconds(num_draft_tokens) + sum(map(self.prior.catch_up_seconds, lags))
        if predicted <= 0:
            return
        self._draft_ratios.append(seconds / predicted)
        scale = self._draft_ratios.median() if len(self._draft_ratios) >= MIN_SAMPLES else 1.0
        self.draft = {k: s * scale for k, s in self.prior.draft.items()}
        if not self._catch_up_ratios:
            self.catch_up = self.prior.catch_up * scale  # no catch-up timed yet: it moves with the drafter

    def _observe_catch_up(self, num_draft_tokens: list[int], seconds: float, lags: list[int]) -> None:
        predicted = sum(map(self.prior.catch_up_seconds, lags))
        if predicted <= 0:
            return
        absorbing = max(0.0, seconds - self.batch_draft_seconds(num_draft_tokens))
        self._catch_up_ratios.append(absorbing / predicted)
        self.catch_up = self.prior.catch_up * self._catch_up_ratios.median()

    def observe_step(self, timing, method: str | None = None) -> None:
        """An engine step's `StepTiming`: its target pass (prefills are no verification: skipped)
        and the call of drafter `method` (None: any drafter's)."""
        if not timing.is_prefill:
            self.observe_target(timing.num_tokens, timing.target_seconds)
        for name, call in timing.drafts.items():
            if method is None or name == method:
                self.observe_draft(call.num_tokens, call.seconds, call.lags)

    def with_overhead(self, seconds: float) -> CostModel:
        """The live tables as a plain `CostModel`, every target pass `seconds` dearer (what a step
        costs beyond its timed pass: scheduling, detokenizing, the host's share)."""
        return CostModel({n: t + seconds for n, t in self.target.items()}, dict(self.draft), self.catch_up,
                         self.key, self.spread, self.rows_padded)

    # --- the live tables ------------------------------------------------------------------------
    def target_ratio(self, num_tokens: int) -> float:
        own = self._target_ratios.get(num_tokens, ())
        if len(own) >= MIN_SAMPLES:
            return own.median()
        if len(self._all_target_ratios) >= MIN_SAMPLES:
            return self._all_target_ratios.median()
        return 1.0

    def _refit_target(self) -> None:
        points = sorted(set(self.prior.target) | {n for n, r in self._target_ratios.items() if len(r) >= MIN_SAMPLES})
        table, highest = {}, 0.0
        for n in points:
            highest = max(highest, self.prior.target_seconds(n) * self.target_ratio(n))  # non-decreasing in n
            table[n] = highest
        self.target = table

    def _check_prior(self) -> None:
        """Drop the prior when the live plain steps sit PRIOR_FAR from it. A profile point is the
        fastest of its repeats, at a 256-token context with nothing else running; real steps are
        spread above that (longer contexts, the sampler, other models' passes between: on a quiet
        machine a held-out run's plain steps had medians 1.05-1.25x the profile and single runs
        crossed 1.5x, which dropped a quietly measured profile at every start). So the fast end
        of the live steps, their lower quartile, is compared: a busy machine slows that too."""
        plain = self._target_ratios.get(1, ())
        if self.prior_dropped or len(plain) < WINDOW:
            return
        ratio = plain.lower_quartile()
        if ratio > PRIOR_FAR or ratio < 1 / PRIOR_FAR:
            self.prior_dropped = True
            logger.warning("the cached cost profile is %.2fx the plain steps measured now: it was measured under "
                           "other conditions; planning with live costs, and measuring afresh at the next start",
                           ratio)
            if self.prior_path is not None:
                self.prior_path.unlink(missing_ok=True)

    def summary(self) -> dict[str, dict]:
        """Prior and live seconds side by side, per n (target) and per k (drafter)."""
        return {"target": {n: {"prior": self.prior.target_seconds(n), "live": self.target_seconds(n),
                               "samples": len(self._target_ratios.get(n, ()))} for n in sorted(self.target)},
                "drafter": {k: {"prior": self.prior.draft_seconds(k), "live": self.draft_seconds(k)}
                          for k in sorted(self.draft)},
                "catch_up_per_token": {"prior": self.prior.catch_up, "live": self.catch_up,
                                       "samples": len(self._catch_up_ratios)}}
