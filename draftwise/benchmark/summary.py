"""The figures of a run: the one speedup definition, and per config and category what the tables show."""

from __future__ import annotations

from draftwise.benchmark.configs import PLAIN
from draftwise.benchmark.runner import ConfigResult, RequestResult
from draftwise.speculative.metrics import SpecMetrics
from draftwise.stats import paired_ratio_interval, percentile


def throughput(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def speedup(tokens: int, seconds: float, base_tokens: int, base_seconds: float) -> float:
    """The speedup of every suite and table: the ratio of throughputs over the same work,

        speedup = (total generated tokens / total seconds) of the config
                  / (total generated tokens / total seconds) of the baseline.

    At batch 1 the work is the run's prompts and a request's seconds run from its arrival to its last
    token (prefill included); under concurrency the work is one level's closed loop (or one client
    count's streams) and its seconds are that level's wall time. Each request thus weighs by its
    duration: the speedup says how much sooner the same workload is done (greedy: the same tokens,
    so it is the ratio of total seconds). It is not Spec-Bench's figure, whose speed.py divides the
    mean of per-prompt tokens/s, which weighs short requests more (the retired bench/speculative.py
    did that too). 0.0 where the baseline produced nothing."""
    base = throughput(base_tokens, base_seconds)
    return throughput(tokens, seconds) / base if base else 0.0


def summarize(results: list[ConfigResult], baseline: str = PLAIN, compare_outputs: bool = True) -> dict:
    """config -> category (and "all") -> figures; speedups over `baseline` (default plain decoding).
    Outputs are compared with each config's `reference` (not when `compare_outputs` is off, as in
    sampled runs, nor for a config whose reference is None: a peer that returns no tokens)."""
    by_name = {r.name: r for r in results}
    base = by_name[baseline]
    categories = list(dict.fromkeys(r.category for r in base.requests)) + ["all"]
    summary: dict = {}
    for config in results:
        reference = by_name.get(config.reference, base) if config.reference is not None else None
        summary[config.name] = {
            category: _figures(_of(config.requests, category), _of(base.requests, category),
                               _of(reference.requests, category) if compare_outputs and reference else None)
            for category in categories}
    return summary


def _of(requests: list[RequestResult], category: str) -> list[RequestResult]:
    return [r for r in requests if category in ("all", r.category)]


def _interval(mine: list[RequestResult], base: list[RequestResult]) -> tuple[float, float] | None:
    """The speedup's 90% interval over the prompts (paired bootstrap: `stats.paired_ratio_interval`);
    None where the two did not run the same prompts."""
    if len(mine) != len(base) or any(a.category != b.category for a, b in zip(mine, base)):
        return None
    return paired_ratio_interval([(a.tokens, a.seconds, b.tokens, b.seconds) for a, b in zip(mine, base)])


def _figures(mine: list[RequestResult], base: list[RequestResult], reference: list[RequestResult] | None) -> dict:
    tokens, seconds = sum(r.tokens for r in mine), sum(r.seconds for r in mine)
    steps = sum(r.steps for r in mine)
    merged = SpecMetrics()
    for r in mine:
        if r.spec:
            merged.merge(SpecMetrics(**r.spec))
    latencies = sorted(r.seconds for r in mine)
    ttfts = [r.ttft for r in mine if r.ttft == r.ttft]  # NaN: not measured (peers)
    prompt_tokens = sum(r.prompt_tokens for r in mine)
    decode_seconds = sum(r.seconds - r.ttft for r in mine if r.ttft == r.ttft)
    return {"requests": len(mine), "tokens": tokens, "seconds": seconds, "tokens_per_s": throughput(tokens, seconds),
            "speedup": speedup(tokens, seconds, sum(r.tokens for r in base), sum(r.seconds for r in base)),
            "speedup_interval": _interval(mine, base),
            "tau": sum(r.tokens - 1 for r in mine) / steps if steps else None,
            "acceptance_rate": merged.acceptance_rate if merged.num_drafts else None,  # None: nothing drafted
            "first_position_acceptance": merged.acceptance_rate_per_position[0] if merged.num_drafts else None,
            "acceptance_by_position": merged.acceptance_rate_per_position,
            "num_drafts": merged.num_drafts, "num_plain_steps": merged.num_plain_steps,
            "num_draft_tokens": merged.num_draft_tokens,
            "draft_share": (merged.draft_seconds / (merged.draft_seconds + merged.verify_seconds)  # time drafting
                            if merged.draft_seconds + merged.verify_seconds > 0 else None),
            "prefill_tokens_per_s": throughput(prompt_tokens, sum(ttfts)) if prompt_tokens and ttfts else None,
            "decode_tokens_per_s": throughput(tokens - len(mine), decode_seconds) if ttfts else None,
            "ttft_p50": percentile(sorted(ttfts), 0.5) if ttfts else None, "latency_p50": percentile(latencies, 0.5),
            "latency_p95": percentile(latencies, 0.95),
            "equal_to_plain": (None if reference is None
                               else sum(a.token_ids == b.token_ids for a, b in zip(mine, reference)))}
