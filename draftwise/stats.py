"""Small statistics shared by the benchmark, the planner and the server's load test."""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """The q-quantile of sorted `values` (nearest rank below); 0.0 for none."""
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0
