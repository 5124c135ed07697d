"""Prometheus metrics, named as vLLM names them (`draftwise:` for `vllm:`).

Speculation counters carry the request's traffic `segment` (bounded: the first MAX_SEGMENTS
distinct labels are kept, later ones count as "other") and the method, so operators can watch
acceptance per kind of traffic and see when one stops paying.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from draftwise.engine.outputs import RequestOutput
from draftwise.speculative.control.policy import MAX_SEGMENTS

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PREDICTION_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 0.95, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._segments: set[str] = set()
        labels = ["model_name"]
        spec_labels = ["model_name", "segment", "method"]
        r = self.registry
        self.requests = Counter("draftwise:request_success", "Finished requests.", labels + ["finished_reason"], registry=r)
        self.aborted = Counter("draftwise:request_aborted", "Requests ended before they finished, by reason "
                               "(client_disconnected, shutdown).", labels + ["reason"], registry=r)
        self.failed = Counter("draftwise:request_failed", "Requests answered with an error, by its code "
                              "(a 4xx's, or engine_error / kv_cache_full for a request that failed while running).",
                              labels + ["reason"], registry=r)
        self.prompt_tokens = Counter("draftwise:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("draftwise:generation_tokens", "Tokens generated.", labels, registry=r)
        self.ttft = Histogram("draftwise:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("draftwise:inter_token_latency_seconds", "Time between streamed tokens (per token).",
                             labels, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("draftwise:e2e_request_latency_seconds", "Arrival to last token.", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("draftwise:num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.waiting = Gauge("draftwise:num_requests_waiting", "Requests queued.", labels, registry=r)
        self.kv_blocks = Gauge("draftwise:kv_cache_blocks_in_use", "Target KV cache blocks in use.", labels, registry=r)
        self.kv_usage = Gauge("draftwise:kv_cache_usage_perc", "Share of the target KV cache in use.", labels,
                              registry=r)
        self.drafts = Counter("draftwise:spec_decode_num_drafts", "Verification steps carrying a draft.",
                              spec_labels, registry=r)
        self.draft_tokens = Counter("draftwise:spec_decode_num_draft_tokens", "Drafted tokens.", spec_labels,
                                    registry=r)
        self.accepted_tokens = Counter("draftwise:spec_decode_num_accepted_tokens", "Accepted draft tokens.",
                                       spec_labels, registry=r)
        self.accepted_per_pos = Counter("draftwise:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position in the draft.",
                                        spec_labels + ["position"], registry=r)
        self.current_k = Gauge("draftwise:spec_decode_current_k", "Mean tokens drafted per row in the last step.",
                               ["model_name", "method"], registry=r)
        self.decode_steps = Counter("draftwise:decode_steps", "Decoding steps (prefills not counted).", labels,
                                    registry=r)
        self.drafting_steps = Counter("draftwise:spec_decode_drafting_steps",
                                      "Decoding steps in which some row carried a draft.", labels, registry=r)
        self.prediction = Histogram("draftwise:spec_decode_step_time_predicted_over_observed",
                                    "A decoding step's time as the live cost model predicted it, over its measured "
                                    "time (1: exact).", labels, buckets=PREDICTION_BUCKETS, registry=r)
        self.prefix_queries = Counter("draftwise:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache (vLLM's name).", labels, registry=r)
        self.prefix_hits = Counter("draftwise:prefix_cache_hits", "Prompt tokens found in the prefix cache "
                                   "(their KV blocks shared, not computed).", labels, registry=r)
        self._steps_seen = (0, 0)
        self._prefix_seen = (0, 0)

    def segment(self, label: str | None) -> str:
        if label is None:
            return "default"
        if label in self._segments or len(self._segments) < MAX_SEGMENTS:
            self._segments.add(label)
            return label
        return "other"

    def observe_aborted(self, reason: str) -> None:
        self.aborted.labels(self.model_name, reason).inc()

    def observe_failed(self, reason: str) -> None:
        self.failed.labels(self.model_name, reason).inc()

    def observe_step(self, stats: dict) -> None:
        """Engine state after anything changed it (from `LLM.engine_stats`)."""
        m = self.model_name
        self.running.labels(m).set(stats["running"])
        self.waiting.labels(m).set(stats["waiting"])
        self.kv_blocks.labels(m).set(stats["kv_blocks_in_use"])
        self.kv_usage.labels(m).set(stats["kv_blocks_in_use"] / stats["kv_blocks"])
        for method, k in stats["current_k"].items():
            self.current_k.labels(m, method).set(k)
        steps, drafting = stats.get("decode_steps", 0), stats.get("drafting_steps", 0)
        self.decode_steps.labels(m).inc(max(0, steps - self._steps_seen[0]))
        self.drafting_steps.labels(m).inc(max(0, drafting - self._steps_seen[1]))
        self._steps_seen = (steps, drafting)
        queries, hits = stats.get("prefix_cache_queries", 0), stats.get("prefix_cache_hits", 0)
        self.prefix_queries.labels(m).inc(max(0, queries - self._prefix_seen[0]))
        self.prefix_hits.labels(m).inc(max(0, hits - self._prefix_seen[1]))
        self._prefix_seen = (queries, hits)
        for ratio in stats.get("predicted_over_observed", ()):
            self.prediction.labels(m).observe(ratio)

    def observe_tokens(self, num_tokens: int, seconds_since_previous: float | None) -> None:
        if num_tokens and seconds_since_previous is not None:
            for _ in range(num_tokens):
                self.itl.labels(self.model_name).observe(seconds_since_previous / num_tokens)

    def observe_finished(self, output: RequestOutput, segment: str, method: str | None) -> None:
        m, metrics = self.model_name, output.metrics
        if output.finish_reason == "error":
            self.observe_failed(output.error_reason or "engine_error")
        else:
            self.requests.labels(m, output.finish_reason or "abort").inc()
        self.prompt_tokens.labels(m).inc(metrics.num_prompt_tokens)
        self.generation_tokens.labels(m).inc(metrics.num_generated_tokens)
        if metrics.time_to_first_token is not None:
            self.ttft.labels(m).observe(metrics.time_to_first_token)
        self.e2e.labels(m).observe(metrics.seconds)
        spec = metrics.spec
        if method is None or spec is None:
            return
        labels = (m, segment, method)
        self.drafts.labels(*labels).inc(spec.num_drafts)
        self.draft_tokens.labels(*labels).inc(spec.num_draft_tokens)
        self.accepted_tokens.labels(*labels).inc(spec.num_accepted_tokens)
        for position, count in enumerate(spec.accepted_per_position):
            self.accepted_per_pos.labels(*labels, str(position)).inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
