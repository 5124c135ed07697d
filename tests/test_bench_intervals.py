"""The benchmark's speedup intervals: a paired bootstrap over prompts, deterministic, as wide as the
prompts disagree and no wider."""

import pytest

from draftwise.benchmark.runner import RequestResult
from draftwise.benchmark.summary import _interval, speedup
from draftwise.stats import paired_ratio_interval


def request(category: str, tokens: int, seconds: float) -> RequestResult:
    return RequestResult(category, tokens, seconds, 0.1, [], tokens - 1)


def test_prompts_that_agree_give_a_point_and_prompts_that_differ_an_interval_around_it():
    assert paired_ratio_interval([(10, 1.0, 10, 2.0)] * 6) == (2.0, 2.0)  # every prompt 2x: no doubt
    # (prompts of very different difficulty, each sped up the same: pairing keeps the interval a point)
    assert paired_ratio_interval([(10, 1.0, 10, 2.0), (100, 50.0, 100, 100.0), (5, 0.1, 5, 0.2)]) == (2.0, 2.0)
    mixed = [(10, 1.0, 10, 2.0), (10, 2.0, 10, 2.0), (10, 1.0, 10, 1.5), (10, 3.0, 10, 2.0)]
    low, high = paired_ratio_interval(mixed)
    point = speedup(40, 7.0, 40, 7.5)
    assert low < point < high and high - low > 0.2
    assert paired_ratio_interval(mixed) == (low, high)  # (seeded)
    assert paired_ratio_interval([(10, 1.0, 10, 2.0)]) == (2.0, 2.0)


def test_unpaired_runs_have_no_interval():
    mine = [request("code", 10, 1.0), request("qa", 10, 1.0)]
    assert _interval(mine, [request("code", 10, 2.0)]) is None
    assert _interval(mine, [request("qa", 10, 2.0), request("code", 10, 2.0)]) is None
    assert _interval(mine, [request("code", 10, 2.0), request("qa", 10, 2.0)]) == pytest.approx((2.0, 2.0))
