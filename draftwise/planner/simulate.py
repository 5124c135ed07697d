"""A simulator of batched serving with and without speculation, from measured costs and acceptance.

The model (what `draftwise plan` predicts with):

Traffic. `Request`s with a prompt length, an output length and a segment. c clients in a closed
loop: each sends its next request as soon as its previous one finishes (the way the concurrency
benchmark and most load generators drive a server), drawing requests from the sample in order.

Engine. The continuous-batching loop of `engine/`: while a request waits and a slot is free, a
prefill step admits it (its first token comes out of that step: time to first token), alternating
with decode steps over every running request (as `engine/scheduler.py` does). A step's duration comes from the machine's
`CostModel`: a prefill over n prompt tokens costs `target_seconds(n)` (or `prefill_seconds(n)`
where prefills were timed: `measure.PrefillCost`); a decode step whose row b
drafts k_b tokens costs `batch_step_seconds([k_b])` - one target pass over sum(k_b + 1) tokens
where the runner packs rows (rows x (max k_b + 1) where it pads them: `CostModel.pass_seconds`)
plus the drafter's rounds, so verification grows with batch x (k + 1).

Acceptance. Per segment, `Acceptance`: the chance that the drafter proposes at all, and a_i, the
chance that drafted token i is accepted given that tokens 0..i-1 were (measured by
`acceptance.py`). Whether a row asked for k tokens gets a draft is drawn each step; one that gets
none (prompt lookup without a match) is a plain row of the step, costing what a plain row costs, as
in the engine (charging it k verified tokens made adaptive prompt lookup look 12-18% slower than
it measured on held-out traffic). A row drafting k tokens commits L + 1 tokens, L the accepted
prefix: with `expected=True` its expectation 1 + a_0 + a_0 a_1 + ... (fractional), otherwise a
sample. Where the requests' own drafts were measured (`replay.py`), they are replayed instead: a
row drafting k tokens at output position p commits what a draft made there would have had
accepted, which keeps the stretches in which a drafter is right or wrong together (i.i.d. draws
lose them, and the controller rides them). With constant a_i = alpha, batch 1 and a verification costing one step, the speedup is
Leviathan et al.'s (1 - alpha^(k+1)) / ((1 - alpha) (k c + 1)), c the draft/target cost ratio.

Policy. `plain` (k = 0), a fixed k, or `adaptive`: the engine's own controller
(`speculative/control/policy.AdaptiveLength`, k <= k_max) replayed step by step. It sees what it sees in the
engine: each row's backlog, tokens left and generated, the segment, and after each step the drafted
and accepted counts, so ski rental on the catch-up, probing and per-segment memory act here as they
do in serving. It learns from whole-token outcomes, so adaptive runs always sample acceptance
(`expected` applies to plain and fixed k).

Catch-up. A drafter with its own cache (a draft model) must first absorb what it has not seen: the
prompt before its first draft, and the tokens of plain steps taken meanwhile. A row's first
drafting step after such a backlog costs `catch_up_seconds(backlog)` more, the backlog capped at
`catch_up_window` tokens (the draft model's context window) where it has one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from draftwise.planner.replay import Replay
from draftwise.speculative.control.cost_model import CostModel
from draftwise.speculative.control.policy import AdaptiveLength
from draftwise.stats import percentile


@dataclass(frozen=True, slots=True)
class Request:
    prompt_tokens: int
    output_tokens: int
    segment: str = ""


@dataclass(frozen=True, slots=True)
class Acceptance:
    conditional: tuple[float, ...]  # a_i = P(token i accepted | tokens 0..i-1 accepted)
    propose_rate: float = 1.0  # share of steps where the drafter has something to propose

    def expected_tokens(self, k: int) -> float:
        """Expected tokens committed by a step drafting k tokens (the drafter proposing): 1 + sum_i prod_{j<=i} a_j."""
        total, survive = 1.0, 1.0
        for i in range(k):
            survive *= self.rate(i)
            total += survive
        return total

    def rate(self, position: int) -> float:
        if not self.conditional:
            return 0.0
        return self.conditional[min(position, len(self.conditional) - 1)]

    def proposes(self, k: int, rng: random.Random) -> bool:
        """Whether a step asking for k tokens gets a draft."""
        return k > 0 and rng.random() < self.propose_rate

    def sample_accepted(self, k: int, rng: random.Random) -> int:
        """Accepted drafted tokens of a step that drafted k."""
        accepted = 0
        while accepted < k and rng.random() < self.rate(accepted):
            accepted += 1
        return accepted


SAMPLE_ROUNDS_PER_CLIENT = 2  # requests each client sends where the clients outnumber the sample
NO_DRAFTS = Acceptance(conditional=(), propose_rate=0.0)


ADAPTIVE_NAME = "adaptive k<="  # an adaptive policy's name, before its largest k


@dataclass(slots=True)
class Policy:
    """`k=0`: plain decoding; `adaptive`: the engine's controller chooses k in 0..k each step."""
    k: int = 0
    adaptive: bool = False

    @property
    def name(self) -> str:
        return "plain" if self.k == 0 else (f"{ADAPTIVE_NAME}{self.k}" if self.adaptive else f"k={self.k}")


def is_adaptive(config: str) -> bool:
    """Whether a config name ("ENTRY adaptive k<=6", "ENTRY k=2": an entry, then a `Policy.name`)
    ends in an adaptive policy: read from the policy part, so that an entry with options
    ("draft:adaptive=false k=2") is not taken for one."""
    return config.rpartition(f" {ADAPTIVE_NAME}")[2].isdigit()


@dataclass(slots=True)
class Prediction:
    concurrency: int
    policy: str
    tokens_per_second: float
    latency_p50: float
    latency_p95: float
    ttft_p50: float
    ttft_p95: float
    mean_k: float  # drafted tokens per row and decode step
    seconds: float
    requests: int
    extra: dict = field(default_factory=dict)


@dataclass(slots=True)
class _Params:
    seed: int | None = None
    greedy: bool = True


@dataclass(slots=True)
class _Running:
    """A request in the batch; also what `AdaptiveLength` reads of a `Sequence`."""
    request: Request
    arrival: float
    remaining: float
    client: int
    backlog: int  # tokens the drafter has not seen yet (1: only the newest, as after a draft)
    index: int = 0  # of the request in the simulated list
    params: _Params = field(default_factory=_Params)
    source: int = 0  # of the request in the sample (its replay; a sample served again repeats it)

    @property
    def request_id(self) -> str:
        return str(self.index)

    @property
    def segment(self) -> str | None:
        return self.request.segment or None

    @property
    def output_ids(self) -> range:  # only its length is read
        return range(self.request.output_tokens - math.ceil(self.remaining))

    @property
    def finish_reason(self) -> str:  # (read when it is released: a simulated request ends only as its answer did)
        return "stop"

    @property
    def num_tokens_left(self) -> int:
        return math.ceil(self.remaining)


def simulate(costs: CostModel, requests: list[Request], acceptance: dict[str, Acceptance], policy: Policy,
             concurrency: int, *, max_num_seqs: int | None = None, expected: bool = False,
             catch_up_window: int | None = None, seed: int = 0, replay: Replay | None = None,
             prefill_seconds: Callable[[int], float] | None = None) -> Prediction:
    """Serve `requests` (each once, in order) to `concurrency` closed-loop clients; predicted figures.
    More clients than requests are served the sample again, in order, until every client has sent
    SAMPLE_ROUNDS_PER_CLIENT requests (the sample once over could keep only as many clients busy as
    it holds, and a level above that would repeat the figures of the sample's size). With `replay`,
    each request's drafts are accepted as they were where it was measured (`replay.py`); requests it
    does not cover propose nothing."""
    rng = random.Random(seed)
    controller = AdaptiveLength(costs, policy.k) if policy.adaptive and policy.k else None
    slots = max_num_seqs or concurrency
    count = len(requests) if concurrency <= len(requests) else SAMPLE_ROUNDS_PER_CLIENT * concurrency
    pending = [(requests[i % len(requests)], i % len(requests)) for i in range(count)] if requests else []
    waiting: list[tuple[Request, int, float, int]] = []  # (request, its place in the sample, arrival, client)
    running: list[_Running] = []
    now, generated = 0.0, 0.0
    latencies, ttfts, drafted, rows_stepped = [], [], 0, 0
    for client in range(min(concurrency, len(pending))):
        waiting.append((*pending.pop(0), 0.0, client))

    def finish(row: _Running) -> None:
        latencies.append(now - row.arrival)
        if controller is not None:
            controller.release(row)
        if pending:
            waiting.append((*pending.pop(0), now, row.client))

    last_was_prefill = False
    while waiting or running:
        if waiting and len(running) < slots and (not running or not last_was_prefill):
            last_was_prefill = True
            request, source, arrival, client = waiting.pop(0)
            now += (prefill_seconds or costs.target_seconds)(max(1, request.prompt_tokens))
            ttfts.append(now - arrival)
            generated += 1
            row = _Running(request, arrival, request.output_tokens - 1, client, request.prompt_tokens + 1,
                           index=len(ttfts) - 1, source=source)
            if row.remaining <= 0:
                finish(row)
            else:
                running.append(row)
            continue
        last_was_prefill = False
        lags = [row.backlog if catch_up_window is None else min(row.backlog, catch_up_window) for row in running]
        if controller is not None:
            ks = controller.num_tokens(running, lags)
        else:
            ks = [policy.k] * len(running)
        ks = [max(0, min(k, math.ceil(row.remaining) - 1)) for row, k in zip(running, ks)]  # as the engine
        rates = [acceptance.get(row.request.segment, NO_DRAFTS) for row in running]
        if replay is None:
            drafts = [k if rate.proposes(k, rng) else 0 for rate, k in zip(rates, ks)]  # no draft: a plain row
            replayed = [None] * len(running)
        else:
            replayed = [replay.accepted(row.source, len(row.output_ids), k) if k else None
                        for row, k in zip(running, ks)]
            drafts = [k if accepted is not None else 0 for k, accepted in zip(ks, replayed)]
        now += costs.batch_step_seconds(drafts)
        now += sum(costs.catch_up_seconds(lag) for lag, k in zip(lags, ks) if k > 0)
        drafted += sum(drafts)
        rows_stepped += len(ks)
        for row, rate, k, accepted in zip(list(running), rates, drafts, replayed):
            if accepted is not None or not k:
                tokens = (accepted or 0) + 1
            elif expected and controller is None:
                tokens = rate.expected_tokens(k)
            else:
                tokens = rate.sample_accepted(k, rng) + 1
            if controller is not None:
                controller.observe(row, k, tokens - 1)
            tokens = min(tokens, row.remaining)
            row.backlog = 1 if k > 0 else row.backlog + math.ceil(tokens)
            row.remaining -= tokens
            generated += tokens
            if row.remaining <= 1e-9:
                running.remove(row)
                finish(row)
    latencies.sort()
    ttfts.sort()
    return Prediction(concurrency, policy.name, generated / now if now else 0.0,
                      percentile(latencies, 0.5), percentile(latencies, 0.95),
                      percentile(ttfts, 0.5), percentile(ttfts, 0.95),
                      drafted / rows_stepped if rows_stepped else 0.0, now, len(latencies))


def leviathan_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Expected speedup of k drafted tokens at acceptance alpha and draft/target cost ratio c,
    verification costing one target step (Leviathan et al. 2023, eq. for the walltime improvement)."""
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * cost_ratio + 1))

