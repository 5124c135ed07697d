"""What the planner measures with the real engine: output lengths, acceptance per segment, and
(for validation) throughput and latency of a closed-loop run.

Acceptance is measured with a fixed k (every step drafts k tokens, so every position is seen) and
turned into conditional rates: a_0 = accepted[0] / drafted[0], a_i = accepted[i] /
min(accepted[i-1], drafted[i]) (the drafts that reached position i with i-1 accepted), from the
per-position counters of `SpecMetrics`. Positions a
drafter rarely reaches keep the last well-measured rate.
"""

from __future__ import annotations

import statistics
import time

from draftwise.llm import LLM
from draftwise.planner.simulate import Acceptance, Request
from draftwise.traffic import TrafficItem
from draftwise.sampling.params import SamplingParams
from draftwise.speculative.metrics import SpecMetrics
from draftwise.stats import percentile

MIN_OBSERVATIONS = 8  # a position seen fewer times keeps the previous position's rate


def plain_requests(llm: LLM, items: list[TrafficItem]) -> tuple[list[Request], float]:
    """Run the sample with plain greedy decoding, one request at a time: each request's lengths,
    and the seconds the run took (the planner calibrates its cost model with them)."""
    llm.set_speculative(None, progress=False)
    llm.generate(items[0].prompt, SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    requests, seconds = [], 0.0
    for item in items:
        output = llm.generate(item.prompt, SamplingParams(temperature=0.0, max_tokens=item.max_tokens))[0]
        requests.append(Request(len(output.prompt_token_ids), max(1, len(output.token_ids)), item.segment))
        seconds += output.metrics.seconds
    return requests, seconds


def measure_acceptance(llm: LLM, items: list[TrafficItem], speculative: dict, k: int) -> dict[str, Acceptance]:
    """Per segment: the drafter's conditional acceptance rates at a fixed k (and how often it proposes)."""
    llm.set_speculative({**speculative, "num_speculative_tokens": k, "adaptive": False}, progress=False)
    by_segment: dict[str, SpecMetrics] = {}
    for item in items:
        output = llm.generate(item.prompt, SamplingParams(temperature=0.0, max_tokens=item.max_tokens),
                              segment=item.segment or None)[0]
        if output.metrics.spec is not None:
            by_segment.setdefault(item.segment, SpecMetrics()).merge(output.metrics.spec)
    return {segment: acceptance_from(metrics) for segment, metrics in by_segment.items()}


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


def run_closed_loop(llm: LLM, prompts: list[str], max_tokens: list[int], concurrency: int,
                    speculative: dict | None = None, segments: list[str | None] | None = None) -> dict:
    """The real engine, `concurrency` requests in flight until every prompt has run once
    (`segments`: each request's traffic label)."""
    queue = list(enumerate(prompts))
    in_flight: dict[str, tuple[int, float]] = {}
    latencies, ttfts, outputs, tokens = [], [], [None] * len(prompts), 0
    first_seen: set[str] = set()
    started = time.perf_counter()
    while queue or in_flight:
        while queue and len(in_flight) < concurrency:
            index, prompt = queue.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens[index])
            request_id = llm.add_request(prompt, params, speculative=speculative,
                                         segment=segments[index] if segments else None)
            in_flight[request_id] = (index, time.perf_counter())
        for output in llm.step():
            index, arrival = in_flight[output.request_id]
            if output.request_id not in first_seen and output.token_ids:
                first_seen.add(output.request_id)
                ttfts.append(time.perf_counter() - arrival)
            if output.finished:
                in_flight.pop(output.request_id)
                first_seen.discard(output.request_id)
                latencies.append(time.perf_counter() - arrival)
                outputs[index] = output.token_ids
                tokens += len(output.token_ids)
    seconds = time.perf_counter() - started
    latencies.sort()
    ttfts.sort()
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "p50": statistics.median(latencies), "p95": percentile(latencies, 0.95),
            "ttft_p50": statistics.median(ttfts) if ttfts else 0.0, "ttft_p95": percentile(ttfts, 0.95),
            "outputs": outputs}

