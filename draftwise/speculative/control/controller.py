"""Choosing how many tokens to draft, per request and per step, to maximise goodput.

Let a_i be the probability that drafted token i is accepted given that tokens 1..i-1 were
(estimated per position from what the request has seen). A step drafting k tokens then commits
in expectation
    E(k) = 1 + sum_{j=1..k} prod_{i=1..j} a_i       (the 1 is the recovered or bonus token)
tokens and costs C(k) = draft(k) + target(k + 1) seconds (the measured `CostModel`), so its
goodput is E(k) / C(k). k = 0 is a plain step: E = 1, C = target(1). The controller takes the
best k up to the configured maximum. With constant a this is Leviathan et al.'s
(1 - a^(k+1)) / ((1 - a)(k c + 1)) for c = draft(1)/target(1) and a flat verification cost.

Estimates are exponential moving averages (running means over the first few observations):
after a draft of length m with r accepted, positions 1..min(r + 1, m) were tried and 1..r
accepted (later positions were never reached and learn nothing; a position with too few
observations borrows the estimate of the one before it). Each position also keeps its long-run
mean, which starts from the prior as if it had been seen PRIOR_STRENGTH times (so that one
unlucky first request does not condemn a drafter). A request starts from its drafter's estimate over earlier requests.

Acceptance comes in stretches (a prompt-lookup drafter copies or it does not), so a run of
rejections may take the moving average below break-even while the drafter is, on the whole, worth
using. When the best choice is k = 0 nothing is learnt, so every plain step lets the moving
average drift back toward the long-run mean (by 1/16): a drafter good on the whole returns after a
few plain steps, one that never pays stays off. The same holds per position: a position not tried
in a step (beyond the k drafted, or after a rejection) drifts toward its long-run mean. Without
that, one rejection at position 2 makes k = 1 the best choice, position 2 is then never tried, and
its low estimate never recovers: a replay of the controller on this machine's cost model with
i.i.d. acceptance 0.8 (where k = 2 is best) settled on k = 1 with position 2 estimated at 0.51.
A drafter that never pays also gets probes: one drafted token after
`interval` plain steps. The first interval is chosen so that probing costs at most 2% of the time
(a probe costs C(1) - C(0) more than a plain step, and a drafter with its own cache first absorbs
the tokens of the plain steps: a probe waits until its catch-up fits the budget too); a rejected
probe doubles it (up to 4x), and it
returns to the first interval after an accepted probe (the lower bounds below need a few before
drafting resumes). A probe that finds nothing
to propose (prompt lookup without a match) costs nothing and is retried at the next step. A new
request starts from the interval its drafter's requests reached.

Confidence. A point estimate after two lucky drafts is not evidence that drafting pays, and a
controller that acts on it loses on text where the drafter is poor (short answers lose most: the
learning is a large share of them). So a step drafts only if the goodput of its k, computed with
each rate's lower confidence bound, beats a plain step by DRAFT_MARGIN: the bound is
a - Z sqrt(a (1 - a) / (n + PRIOR_PSEUDO_COUNT)), n the observations behind a. (Not capped at the
moving average's memory: the bound is for the early steps, where a few observations stand for the
drafter; with a cap it sat permanently an EMA's noise below the rate, and with i.i.d. acceptance 0.8
where drafting pays from 0.46 the controller spent a third of its steps plain.) Whether to draft is asked of the
bounds; how much, of the point estimates (the bounds would shorten every draft of a good drafter:
with i.i.d. acceptance 0.8, where k = 2-3 is best, they chose k <= 1 in half the steps). Before any evidence the optimistic
prior still clears it for a cheap drafter, so a first draft finds out; the first observations
weigh 1/2, 1/3, ... (the prior counts once), so two early rejections take 0.8 to 0.27 and the
request plain; probes bring it back where the drafter turns good.
Off by default (Z = 0, margin 0: the point estimates decide, as before): on held-out prompts of eight
kinds (BENCHMARKS.md, the controller issue) Z = 1 and Z = 0.5 with a 2% margin took the draft model
from 1.04x to 1.00x and 0.98x overall (code: 1.10x to 0.94x and 1.00x) and prompt lookup from 1.12x
to 1.08x and 1.07x, against a run-to-run noise of ~4%: on a CPU where a draft-model step costs 1.4
plain steps, the bound keeps a good drafter off until it has evidence, and a 64-token answer
ends before it has any.

A drafter with its own cache must first absorb what it has not seen (the prompt, before its first
draft). That one-off cost is worth paying only if the request goes on long enough to earn it
back. The policy estimates the tokens a request has left from the lengths of its drafter's
finished requests (those that ran past the current length). Without that history, how long a
request will run is unknown (max_tokens is only a bound; most chat answers end far earlier at EOS)
and it is the ski-rental problem: keep "renting" (plain steps, forgoing a saving of
s = C(0) - C(k)/E(k) seconds per token) until what was forgone, s times the tokens generated so
far, reaches the price of "buying" (the catch-up time), then buy; that never costs more than twice
the best choice in hindsight. A probe that needs a catch-up obeys the same horizon. In a batch of
B rows every row waits while one row's drafter catches up, so the catch-up costs B times its time
(in row-seconds, against the drafting row's own saving). Before this factor existed, the server
load run measured speculation 5-6% slower than plain at 4 and 16 clients.

Slow start. How much to draft asks the point estimates, and a position seldom tried borrows the
rate of the one before it; after one fully accepted draft of 3 (running means 0.9 at positions
1-3, borrowed by 4-7) the next draft was 7 tokens long. On a held-out translation that draft was
rejected at its first token: 7 draft-model tokens and an 8-token pass (~2.6 plain steps) spent on
a 15-token answer, which ended 13% slower than plain. So a draft may reach at most twice the
deepest position ever tried (SLOW_START before anything was tried), as TCP's window grows:
2, 4, 8 while drafts are accepted to their end. A segment that learnt its depths passes them on,
so only unexplored depth is held back.

Both rules buy once the saving reaches CATCH_UP_MARGIN times the catch-up. A margin of 2 was
tried (adaptive run 5) and dropped: it protects short answers (in a replay of the benchmark's mix
with i.i.d. acceptance, margin 1 lost 3-4% on translation and QA, margin 2 lost 0-2%), but it also
stops learning. On HumanEval the first request happened to accept 5 of 11 drafts, and the next
ten requests (up to 128 tokens) never drafted, although the draft model is accepted 83-90% there.
Replaying such a first request (two of its drafts rejected at the first position): at margin 2 a
128-token request never buys the catch-up; at margin 1 it buys after 41 tokens and finds out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from draftwise.speculative.control.cost_model import CostModel

CATCH_UP_MARGIN = 1.0  # buy once the forgone (or expected) saving reaches this many times the catch-up cost
PRIOR_ACCEPTANCE = 0.8  # before anything is seen: optimistic, so that a first draft finds out
PRIOR_STRENGTH = 8  # the long-run mean starts as the prior worth this many observations
EMA_WEIGHT = 0.2
MIN_OBSERVATIONS = 4
DRIFT_PER_PLAIN_STEP = 1 / 16  # how far an idle estimate moves back toward its long-run mean per plain step
PROBE_BUDGET = 0.02  # the share of decoding time the first probing interval may cost
MAX_BACK_OFF = 4  # failed probes stretch the interval up to this many times the first
DRAFT_MARGIN = 0.0  # drafting must beat a plain step's goodput by this much, at the rates' lower bounds
CONFIDENCE_Z = 0.0  # lower bound = rate - Z standard errors (off: see the module's docstring)
PRIOR_PSEUDO_COUNT = 2  # observations the prior is worth in the standard error
SLOW_START = 2  # the longest draft before any position was tried; then twice the deepest tried


@dataclass(slots=True)
class AcceptanceEstimate:
    rates: list[float]  # [K]: a_i for drafted positions i = 1..K (index 0 is position 1)
    counts: list[int] = field(default_factory=list)  # [K]: observations behind each rate
    means: list[float] = field(default_factory=list)  # [K]: long-run mean acceptance per position
    weight: float = EMA_WEIGHT

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * len(self.rates)
        self.means = self.means or list(self.rates)

    @classmethod
    def prior(cls, max_tokens: int, rate: float = PRIOR_ACCEPTANCE) -> "AcceptanceEstimate":
        return cls([rate] * max_tokens)

    def copy(self) -> "AcceptanceEstimate":
        return AcceptanceEstimate(list(self.rates), list(self.counts), list(self.means), self.weight)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return  # a plain step: nothing tried (the controller lets idle estimates drift)
        tried = min(num_accepted + 1, num_drafted, len(self.rates))
        for i in range(tried):
            self.counts[i] += 1
            accepted = float(i < num_accepted)
            weight = max(self.weight, 1.0 / (self.counts[i] + 1))  # a running mean until the EMA takes over
            self.rates[i] += weight * (accepted - self.rates[i])
            self.means[i] += (accepted - self.means[i]) / (self.counts[i] + PRIOR_STRENGTH)
        self.drift(start=tried)

    def drift(self, weight: float = DRIFT_PER_PLAIN_STEP, start: int = 0) -> None:
        """Move the moving averages of positions `start`.. (not tried this step) a step back toward
        their long-run means."""
        for i in range(start, len(self.rates)):
            self.rates[i] += weight * (self.means[i] - self.rates[i])

    def lower_bounds(self) -> list[float]:
        """Each effective rate minus CONFIDENCE_Z standard errors of the observations behind it."""
        bounds, count = [], 0
        for i, rate in enumerate(self.effective_rates()):
            if i == 0 or self.counts[i] >= MIN_OBSERVATIONS:
                count = self.counts[i]  # (a borrowed rate keeps its lender's count)
            n = count + PRIOR_PSEUDO_COUNT
            bounds.append(max(0.0, rate - CONFIDENCE_Z * math.sqrt(rate * (1 - rate) / n)))
        return bounds

    def depth_cap(self) -> int:
        """The longest draft the evidence supports: twice the deepest position ever tried
        (SLOW_START while none was)."""
        deepest = max((i + 1 for i, count in enumerate(self.counts) if count), default=0)
        return max(SLOW_START, 2 * deepest)

    def effective_rates(self) -> list[float]:
        """The rates decisions use: a position seldom tried (k rarely reached it) is assumed as good
        as the one before it, so a controller that settled on a small k can still find out that
        a larger one pays."""
        effective: list[float] = []
        for i, (rate, count) in enumerate(zip(self.rates, self.counts)):
            effective.append(rate if i == 0 or count >= MIN_OBSERVATIONS else effective[-1])
        return effective


def expected_tokens(rates: list[float], num_draft_tokens: int) -> float:
    """E(k): tokens a step drafting k tokens commits on average, recovered/bonus token included."""
    total, reach = 1.0, 1.0
    for rate in rates[:num_draft_tokens]:
        reach *= rate
        total += reach
    return total


def best_num_tokens(rates: list[float], costs: CostModel, max_tokens: int) -> int:
    """argmax over k = 0..max_tokens of E(k) / C(k) (ties go to the smaller k)."""
    best_k, best_goodput = 0, 1.0 / costs.step_seconds(0)
    for k in range(1, min(max_tokens, len(rates)) + 1):
        goodput = expected_tokens(rates, k) / costs.step_seconds(k)
        if goodput > best_goodput * (1 + 1e-9):
            best_k, best_goodput = k, goodput
    return best_k


def confident_num_tokens(estimate: AcceptanceEstimate, costs: CostModel, max_tokens: int) -> int:
    """k to draft: 0 unless some k beats a plain step by DRAFT_MARGIN at the rates' lower bounds
    (whether to draft asks for confidence); then the point estimate's best (how much to draft
    asks for the best guess: the bounds would shorten every draft of a good drafter)."""
    bounds = estimate.lower_bounds()
    k_bound = best_num_tokens(bounds, costs, max_tokens)
    if not k_bound or expected_tokens(bounds, k_bound) / costs.step_seconds(k_bound) \
            <= (1 + DRAFT_MARGIN) / costs.step_seconds(0):
        return 0
    return best_num_tokens(estimate.effective_rates(), costs, max_tokens) or k_bound


@dataclass(slots=True)
class GoodputController:
    """One request's choice of k, step after step."""

    costs: CostModel
    max_tokens: int
    estimate: AcceptanceEstimate
    probe_interval: int = 8  # the shortest first probing interval (the cost bound may make it longer)
    start_interval: int | None = None  # where the back-off starts (a drafter's earlier requests may have grown it)
    _first_interval: int = field(init=False, default=0)
    _probe_extra: float = field(init=False, default=0.0)  # a probe's cost beyond a plain step, catch-up aside
    _interval: int = field(init=False, default=0)
    _plain_steps: int = field(init=False, default=0)
    _probing: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        plain = self.costs.step_seconds(0)
        self._probe_extra = max(0.0, self.costs.step_seconds(1) - plain)
        self._first_interval = max(self.probe_interval, math.ceil(self._probe_extra / (PROBE_BUDGET * plain)))
        self._interval = self.start_interval or self._first_interval

    def choose(self, lag: int = 1, tokens_left: int | None = None, generated: int | None = None,
               expected_left: float | None = None, batch_rows: int = 1) -> int:
        """k for the next step. `lag`: tokens the drafter must absorb first; `tokens_left`: the most
        tokens the request may still emit; `generated`: tokens it has emitted; `expected_left`: the
        tokens it is expected to emit still (None: unknown, then `generated` stands in; all None:
        unbounded); `batch_rows`: the rows of the step, which all wait for a catch-up."""
        rates = self.estimate.effective_rates()
        k = confident_num_tokens(self.estimate, self.costs, self.max_tokens)
        self._probing = False
        guess = expected_left if expected_left is not None else generated
        horizon = min(x for x in (tokens_left, guess, math.inf) if x is not None)
        # In a batch every row waits for one row's catch-up: B rows lose its time each, while the
        # saving is the drafting row's alone (row-seconds on both sides).
        catch_up = self.costs.catch_up_seconds(lag) * batch_rows
        if k and not self._earns_back(rates, k, catch_up, horizon):
            k = 0
        elif k:
            k = min(k, self.estimate.depth_cap())  # (the catch-up was weighed against the long-run saving)
            self._plain_steps = 0  # (a probe's budget counts the plain steps since drafting last)
        else:
            self._plain_steps += 1
            if self._plain_steps >= self._interval and self._probe_is_cheap(catch_up, horizon):
                self._plain_steps, self._probing = 0, True
                return 1
        if k == 0:
            self.estimate.drift()
        return k

    def _earns_back(self, rates: list[float], k: int, catch_up: float, horizon: float) -> bool:
        if catch_up == 0:
            return True
        saving_per_token = self.costs.step_seconds(0) - self.costs.step_seconds(k) / expected_tokens(rates, k)
        return saving_per_token * horizon >= CATCH_UP_MARGIN * catch_up

    def _probe_is_cheap(self, catch_up: float, horizon: float) -> bool:
        """A probe that must first absorb a backlog may cost (in row-seconds) at most a tenth of
        the plain decoding time of the horizon, and its whole extra cost, the catch-up included,
        at most PROBE_BUDGET of the plain steps it follows. (A draft model's backlog grows with
        every plain step: absorbing it costs ~1.4 ms a token against a ~45 ms plain step on this
        project's CPU, more than the 2% budget itself, so probes every first interval cost ~5% of
        the time where the drafter never pays; a backlog capped by its context window lets a
        probe through after enough plain steps.)"""
        plain = self.costs.step_seconds(0)
        extra = self._probe_extra + catch_up  # (the draft's part as priced for the first interval: a
        # drafter dear for a while must still be probed to find out that it is cheap again)
        return catch_up <= 0.1 * horizon * plain and extra <= PROBE_BUDGET * self._plain_steps * plain

    @property
    def interval(self) -> int:
        """Plain steps before the next probe, as backed off so far."""
        return self._interval

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.estimate.observe(num_drafted, num_accepted)
        if not self._probing:
            return
        if not num_drafted:  # nothing to propose: the probe cost nothing, try again next step
            self._plain_steps = self._interval
        elif num_accepted or confident_num_tokens(self.estimate, self.costs, self.max_tokens):
            self._interval = self._first_interval  # evidence for drafting: probe at the first interval again
        elif not num_accepted:
            self._interval = min(2 * self._interval, MAX_BACK_OFF * self._first_interval)
