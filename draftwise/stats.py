"""Small statistics shared by the benchmark, the planner and the server's load test."""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """The q-quantile of `values`, interpolated between the two nearest ranks (numpy's default, so
    the 0.5-quantile is `statistics.median`); 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    place = q * (len(ordered) - 1)
    below = int(place)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (place - below)


BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0  # (the same run gives the same interval)


def paired_ratio_interval(pairs: list[tuple[float, float, float, float]], level: float = 0.9) -> tuple[float, float]:
    """A bootstrap interval for (sum a / sum b) / (sum c / sum d) over items (a, b, c, d), the items
    drawn with replacement together (a config's and its baseline's figures of the same prompt stay
    paired, so the prompts' own spread in difficulty does not widen it): the central `level` share of
    BOOTSTRAP_RESAMPLES resampled ratios. With one item, the ratio itself twice."""
    import random

    def ratio(items) -> float:
        a, b, c, d = (sum(column) for column in zip(*items))
        return (a / b) / (c / d) if b > 0 and c > 0 and d > 0 else 0.0

    if len(pairs) < 2:
        value = ratio(pairs) if pairs else 0.0
        return value, value
    draw = random.Random(BOOTSTRAP_SEED)
    ratios = sorted(ratio([pairs[draw.randrange(len(pairs))] for _ in pairs]) for _ in range(BOOTSTRAP_RESAMPLES))
    tail = (1 - level) / 2
    return percentile(ratios, tail), percentile(ratios, 1 - tail)
