"""A closed loop over the step API: a fixed number of requests in flight until every prompt has run.

The planner validates its predictions with it, and `draftwise bench --suite concurrency` measures
continuous batching with it.
"""

from __future__ import annotations

import statistics
import time

from draftwise.llm.llm import LLM
from draftwise.sampling.params import SamplingParams
from draftwise.stats import percentile


def run_closed_loop(llm: LLM, prompts: list[str], max_tokens: list[int], concurrency: int,
                    speculative: dict | None = None, segments: list[str | None] | None = None,
                    params: list[SamplingParams] | None = None) -> dict:
    """The real engine, `concurrency` requests in flight (a finished one is replaced at once by the next
    prompt) until every prompt has run once, greedy (or each with its own `params`, which then
    carry the max_tokens). `segments`: each request's traffic label.
    Returns tokens, seconds (the loop's wall time), tokens_per_s, latency p50 / p95 (arrival to last
    token), TTFT p50 / p95, the latencies and TTFTs themselves (sorted), and each prompt's output
    token ids."""
    queue = list(enumerate(prompts))
    in_flight: dict[str, tuple[int, float]] = {}
    latencies, ttfts, outputs, tokens = [], [], [None] * len(prompts), 0
    first_seen: set[str] = set()
    started = time.perf_counter()
    while queue or in_flight:
        while queue and len(in_flight) < concurrency:
            index, prompt = queue.pop(0)
            request_params = params[index] if params else SamplingParams(temperature=0.0, max_tokens=max_tokens[index])
            request_id = llm.add_request(prompt, request_params, speculative=speculative,
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
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, **_spread(latencies, ttfts),
            "outputs": outputs}


def merge_rounds(loops: list[dict]) -> dict:
    """Rounds of the same closed loop (as `run_closed_loop` returns them) as one: tokens and seconds
    summed, latencies and TTFTs pooled, every round's outputs in order; `rounds`: each round's
    tokens/s."""
    tokens, seconds = sum(loop["tokens"] for loop in loops), sum(loop["seconds"] for loop in loops)
    latencies = sorted(x for loop in loops for x in loop["latencies"])
    ttfts = sorted(x for loop in loops for x in loop["ttfts"])
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, **_spread(latencies, ttfts),
            "outputs": [ids for loop in loops for ids in loop["outputs"]],
            "rounds": [loop["tokens_per_s"] for loop in loops]}


def _spread(latencies: list[float], ttfts: list[float]) -> dict:
    return {"p50": statistics.median(latencies), "p95": percentile(latencies, 0.95),
            "ttft_p50": statistics.median(ttfts) if ttfts else 0.0, "ttft_p95": percentile(ttfts, 0.95),
            "latencies": latencies, "ttfts": ttfts}
