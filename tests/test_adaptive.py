"""The cost model, the goodput controller's decisions, and the measured profile behind them."""

import json
import math
import re

import pytest

from draftwise import LLM
from draftwise.speculative.control.controller import (CATCH_UP_MARGIN, AcceptanceEstimate, GoodputController,
                                           best_num_tokens, expected_tokens)
from draftwise.speculative.control.cost_model import CostModel
from draftwise.speculative.control import profile
from draftwise.speculative.control.profile import measure, profile_path
from draftwise.cli import main
from tests.clocks import WorkClock


def costs(plain=0.070, per_extra_token=0.012, draft_per_token=0.020, catch_up=0.0, cliff_at=None):
    """A synthetic cost model: target(n) = plain + (n - 1) * per_extra_token, draft(k) = k * draft_per_token."""
    target = {n: plain + (n - 1) * per_extra_token for n in range(1, 17)}
    if cliff_at is not None:
        target = {n: t * (3 if n >= cliff_at else 1) for n, t in target.items()}
    return CostModel(target, {k: k * draft_per_token for k in range(1, 17)}, catch_up)


def test_expected_tokens_is_the_leviathan_sum():
    alpha = 0.8
    for k in range(0, 9):
        assert expected_tokens([alpha] * 8, k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))


def test_goodput_matches_the_leviathan_speedup_with_flat_verification():
    alpha, c = 0.7, 0.25
    model = CostModel({n: 1.0 for n in range(1, 17)}, {k: k * c for k in range(1, 17)})
    for k in range(1, 9):
        speedup = expected_tokens([alpha] * 8, k) / model.step_seconds(k) * model.step_seconds(0)
        assert speedup == pytest.approx((1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1)))


def test_expensive_verification_and_low_acceptance_mean_plain_steps():
    model = costs(per_extra_token=0.060, draft_per_token=0.030)
    assert best_num_tokens([0.3] * 8, model, 8) == 0
    assert best_num_tokens([0.6] * 8, costs(cliff_at=2), 8) == 0  # verifying 2 tokens costs 3x


def test_cheap_verification_and_high_acceptance_mean_long_drafts():
    model = costs(per_extra_token=0.001, draft_per_token=0.002)
    assert best_num_tokens([0.95] * 8, model, 8) >= 6
    assert best_num_tokens([0.95] * 8, model, 3) == 3  # num_speculative_tokens is the upper bound
    assert best_num_tokens([0.95, 0.95, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1], model, 8) == 2  # per-position estimates


def test_the_cost_cliff_of_the_int4_kernel_caps_k():
    assert best_num_tokens([0.95] * 8, costs(cliff_at=5), 8) == 3  # 5+ verified tokens cost 3x


def test_estimate_learns_only_from_positions_that_were_tried():
    estimate = AcceptanceEstimate([0.5] * 4, weight=0.5)
    estimate.observe(num_drafted=4, num_accepted=1)  # position 1 accepted, 2 rejected, 3 and 4 never tried
    assert estimate.rates == [0.75, 0.25, 0.5, 0.5]
    estimate.observe(num_drafted=2, num_accepted=2)  # both accepted; nothing about position 3
    assert estimate.rates == [0.875, 0.625, 0.5, 0.5]


def first_probe_interval(model):
    """Plain steps between probes at first: a probe's extra cost is at most 2% of the decoding time."""
    return math.ceil((model.step_seconds(1) - model.step_seconds(0)) / (0.02 * model.step_seconds(0)))


def test_controller_backs_off_probes_and_recovers():
    model = costs()
    controller = GoodputController(model, 4, AcceptanceEstimate.prior(4, 0.9))
    first = first_probe_interval(model)
    assert controller.interval == first > 8
    assert controller.choose() > 0
    choices = []
    for _ in range(600):  # acceptance collapses: every draft rejected
        k = controller.choose()
        choices.append(k)
        controller.observe(k, 0)
    assert choices[-1] == 0 and choices.count(0) > 560
    probes = [i for i, k in enumerate(choices) if k and i > 20]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[-1] == 4 * first and gaps[0] < gaps[-1]  # failed probes space out, up to 4x
    for step in range(1000):  # acceptance returns: probes succeed and the controller drafts again
        k = controller.choose()
        controller.observe(k, k)
        if k >= 2:
            break
    assert k >= 2 and step < 4 * 4 * first
    assert controller.interval == first  # drafting pays again: the back-off is over


def test_an_idle_estimate_drifts_back_to_the_long_run_mean():
    """A drafter good on the whole (long-run acceptance 0.8) returns after a bad stretch without
    a probe's evidence (within two probe intervals: its rate must drift back far enough for the
    lower bound to clear the bar); one that never pays (0.1) drafts only its probes."""
    model = costs()
    for long_run, returns in ((0.8, True), (0.1, False)):
        estimate = AcceptanceEstimate.prior(4, 0.5)
        for i in range(200):
            estimate.observe(1, int(i % 10 < long_run * 10))
        controller = GoodputController(model, 4, estimate)
        for _ in range(8):  # a bad stretch
            controller.observe(1, 0)
        assert controller.choose() == 0
        drafted_without_probing = []
        for _ in range(2 * first_probe_interval(model)):
            k = controller.choose()
            drafted_without_probing.append(k > 0 and not controller._probing)
        assert any(drafted_without_probing) == returns


def test_a_position_not_tried_recovers_and_the_best_k_is_found():
    """I.i.d. acceptance 0.8 on a cost model where k = 2 is best. One rejection at position 2 must
    not settle the controller on k = 1 for good (untried positions drift back), and plain steps
    taken for want of confidence must stay rare: over 10 runs, after 200 steps of learning, the
    controller's goodput is within 5% of the best fixed k's on average (10% in the worst run)."""
    import random
    import statistics

    model = costs(per_extra_token=0.010, draft_per_token=0.020)
    alpha = 0.8
    best = best_num_tokens([alpha] * 8, model, 8)
    assert best >= 2
    ideal = expected_tokens([alpha] * 8, best) / model.step_seconds(best)
    ratios = []
    for seed in range(10):
        controller = GoodputController(model, 8, AcceptanceEstimate.prior(8, alpha))
        rng = random.Random(seed)
        tokens = seconds = 0.0
        for step in range(600):
            k = controller.choose()
            accepted = 0
            while accepted < k and rng.random() < alpha:
                accepted += 1
            controller.observe(k, accepted)
            if step >= 200:
                tokens, seconds = tokens + accepted + 1, seconds + model.step_seconds(k)
        ratios.append(tokens / seconds / ideal)
        assert abs(controller.estimate.means[1] - alpha) < 0.1
    assert statistics.mean(ratios) > 0.95 and min(ratios) > 0.9, ratios


def test_probes_of_a_drafter_with_a_backlog_stay_within_the_budget():
    """A draft model that never pays falls behind by a token every plain step; a probe must first
    absorb that backlog (capped at its context window). Probing, catch-ups included, costs at most
    2% of the decoding time, and still happens (at every first interval it cost ~8% here)."""
    model = costs(catch_up=0.005)  # 5 ms a backlog token against a 70 ms plain step
    window = 128
    controller = GoodputController(model, 4, AcceptanceEstimate.prior(4, 0.05))
    behind, probes, extra = 0, 0, 0.0
    steps = 5000
    for _ in range(steps):
        lag = min(behind + 1, window)
        k = controller.choose(lag=lag)
        controller.observe(k, 0)
        if k:
            probes += 1
            extra += model.step_seconds(k) - model.step_seconds(0) + model.catch_up_seconds(lag)
            behind = 0  # caught up; the rejected draft leaves only the correction to absorb
        else:
            behind += 1
    assert probes >= 3
    assert extra <= 0.02 * steps * model.step_seconds(0)


def test_a_probe_with_nothing_to_propose_is_retried_at_once():
    controller = GoodputController(costs(), 4, AcceptanceEstimate.prior(4, 0.05))
    choices = [controller.choose() for _ in range(controller.interval)]
    assert choices[-1] == 1 and not any(choices[:-1])
    controller.observe(0, 0)  # prompt lookup found no match: nothing was verified
    assert controller.choose() == 1


def test_controller_skips_a_catch_up_that_cannot_pay_off():
    model = costs(catch_up=0.005)  # 5 ms per backlog token
    controller = GoodputController(model, 4, AcceptanceEstimate.prior(4, 0.8))
    assert controller.choose(lag=1000, tokens_left=10) == 0  # 5 s of catch-up for 10 tokens
    assert controller.choose(lag=1000, tokens_left=100_000) > 0
    assert controller.choose(lag=2, tokens_left=10) > 0


def test_catch_up_waits_until_the_request_has_proven_long_ski_rental():
    """Without a length estimate, the saving forgone so far (tokens generated x saving per token)
    must reach the catch-up's cost."""
    model = costs(catch_up=0.005)
    controller = GoodputController(model, 4, AcceptanceEstimate.prior(4, 0.8))
    k = best_num_tokens([0.8] * 4, model, 4)
    saving = model.step_seconds(0) - model.step_seconds(k) / expected_tokens([0.8] * 4, k)
    catch_up = model.catch_up_seconds(100)
    first = next(g for g in range(1, 1000) if controller.choose(lag=100, tokens_left=10_000, generated=g) > 0)
    assert first == pytest.approx(CATCH_UP_MARGIN * catch_up / saving, abs=1)
    assert controller.choose(lag=1, tokens_left=10_000, generated=0) > 0  # no backlog: draft at once
    # With an estimate of the tokens left, decide at once, either way.
    assert controller.choose(lag=100, tokens_left=10_000, generated=0, expected_left=1.2 * first) > 0
    assert controller.choose(lag=100, tokens_left=10_000, generated=500, expected_left=first / 2) == 0


def test_policy_expects_the_tokens_left_from_finished_requests():
    from types import SimpleNamespace

    from draftwise.speculative.control.policy import AdaptiveLength

    policy = AdaptiveLength(costs(), 4)
    assert policy.overall.expected_tokens_left(0) is None  # no history yet: ski rental
    for i, length in enumerate([20, 30, 100, 200, 300]):
        seq = SimpleNamespace(request_id=str(i), params=SimpleNamespace(seed=None), num_tokens_left=10,
                              output_ids=[0] * length, finish_reason="stop")
        policy.num_tokens([seq], [1])
        policy.release(seq)
    assert policy.overall.expected_tokens_left(0) == pytest.approx(130)
    assert policy.overall.expected_tokens_left(25) == pytest.approx((5 + 75 + 175 + 275) / 4)
    assert policy.overall.expected_tokens_left(150) is None  # only 2 requests ran that long


def test_cost_model_interpolates_and_round_trips(tmp_path):
    model = CostModel({1: 0.1, 4: 0.4, 8: 0.6}, {1: 0.02, 2: 0.04}, 0.001, key="k")
    assert model.target_seconds(2) == pytest.approx(0.2)
    assert model.target_seconds(12) == pytest.approx(0.8)  # extrapolated along the last segment
    assert model.draft_seconds(4) == pytest.approx(0.08)
    assert model.catch_up_seconds(11) == pytest.approx(0.01)
    model.write(tmp_path / "m.json")
    assert CostModel.read(tmp_path / "m.json") == model
    (tmp_path / "bad.json").write_text("{")
    assert CostModel.read(tmp_path / "bad.json") is None


def test_profile_is_measured_once_and_cached(tiny_qwen, tmp_path, monkeypatch):
    monkeypatch.setenv(profile.PROFILES_ENV, str(tmp_path))  # not what earlier tests measured
    clock = WorkClock(monkeypatch, "draftwise.speculative.control.profile")
    measured = []
    monkeypatch.setattr(profile, "measure", lambda *args: measured.append(args) or measure(*args))
    llm = LLM(str(tiny_qwen), max_model_len=256, progress=False,
              speculative={"method": "draft", "model": str(tiny_qwen), "num_speculative_tokens": 4})
    model = llm.cost_model
    assert len(measured) == 1
    assert model.target == pytest.approx({n: clock.cost(n) for n in profile.TARGET_SIZES})
    # Each draft of k tokens: k one-token forwards of the draft model (it holds all but the newest token).
    assert model.draft == pytest.approx({k: k * clock.cost(1) for k in (1, 2, 3, 4)})
    # From scratch, the draft model reads its 128-token window at once: 127 tokens more than a warm draft.
    assert model.catch_up == pytest.approx(clock.per_token)
    path = profile_path(model.key)
    assert json.loads(path.read_text())["key"] == model.key
    again = LLM(str(tiny_qwen), max_model_len=256, progress=False,
                speculative={"method": "draft", "model": str(tiny_qwen), "num_speculative_tokens": 4})
    assert again.cost_model == model and len(measured) == 1  # read back, not measured again
    ngram = LLM(str(tiny_qwen), max_model_len=256, progress=False, speculative={"method": "ngram"})
    assert len(measured) == 2 and ngram.cost_model.key != model.key
    assert ngram.cost_model.catch_up == 0 and set(ngram.cost_model.draft.values()) == {0.0}  # no model runs


def test_the_profile_times_a_target_pass_until_the_device_has_run_it(tiny_llm, monkeypatch):
    """On a GPU `forward` returns before its pass has run: every timed pass waits for the device
    before the clock stops (without it an H200 profile read one token at 0.45 ms, two at 5.5 ms)."""
    runner = tiny_llm.runner
    events = []
    forward, truncate = runner.forward, runner.truncate
    monkeypatch.setattr(runner, "forward", lambda *args, **kw: events.append("forward") or forward(*args, **kw))
    monkeypatch.setattr(runner, "truncate", lambda *args: events.append("truncate") or truncate(*args))
    monkeypatch.setattr(runner, "synchronize", lambda: events.append("synchronize"))
    measure(runner, None, tiny_llm.tokenizer, 2)
    timed = [i for i, event in enumerate(events) if event == "forward"][1:]  # (the first fills the cache)
    assert len(timed) == (profile.REPEATS + 1) * len(profile.TARGET_SIZES)
    assert all(events[i + 1:i + 3] == ["synchronize", "truncate"] for i in timed)


def test_profile_command_prints_the_table(tiny_qwen, capsys):
    assert main(["profile", "--model", str(tiny_qwen), "--method", "ngram", "-k", "3"]) == 0
    out = capsys.readouterr().out
    assert "target forward ms" in out and "best k" in out


def test_profile_command_shows_live_costs_beside_the_profile(tiny_qwen, capsys):
    assert main(["profile", "--model", str(tiny_qwen), "--method", "ngram", "-k", "3", "--live", "24"]) == 0
    out = capsys.readouterr().out
    assert "Live costs after 24 generated tokens" in out and "| n | profile ms | live ms |" in out
    plain_row = re.search(r"^\| 1 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| (\d+) \|$", out, re.M)
    assert plain_row and int(plain_row.group(1)) > 0  # plain steps were timed and learnt from


def test_rarely_tried_positions_borrow_the_estimate_before_them():
    estimate = AcceptanceEstimate.prior(4, 0.5)
    for _ in range(10):
        estimate.observe(num_drafted=1, num_accepted=1)  # k = 1 every time: positions 2..4 never tried
    assert estimate.rates[1:] == [0.5, 0.5, 0.5]
    assert estimate.effective_rates() == [estimate.rates[0]] * 4 and estimate.rates[0] > 0.9
    model = costs(per_extra_token=0.005, draft_per_token=0.005)
    assert best_num_tokens(estimate.effective_rates(), model, 4) > 1  # so the controller tries a longer draft


def test_probing_back_off_carries_over_to_the_next_request():
    from types import SimpleNamespace

    from draftwise.speculative.control.policy import AdaptiveLength

    policy = AdaptiveLength(costs(), 4)
    policy.overall.estimate = AcceptanceEstimate.prior(4, 0.05)  # this drafter is useless here
    first = SimpleNamespace(request_id="a", params=SimpleNamespace(seed=None), num_tokens_left=1000, output_ids=[])
    for _ in range(300):
        k, = policy.num_tokens([first], [1])
        policy.observe(first, k, 0)
    assert policy.overall.interval == 4 * first_probe_interval(costs())
    second = SimpleNamespace(request_id="b", params=SimpleNamespace(seed=None), num_tokens_left=1000, output_ids=[])
    choices = [policy.num_tokens([second], [1])[0] for _ in range(policy.overall.interval)]
    assert choices.index(1) == policy.overall.interval - 1  # no early probe: the back-off was learnt


def test_a_batch_lowers_k_and_turns_speculation_off_when_it_would_lose():
    """Solo, each row drafts; in a batch the shared verification pass grows with every drafted
    token, so k comes down, and a large batch takes plain steps."""
    from types import SimpleNamespace

    from draftwise.speculative.control.policy import AdaptiveLength

    # A CPU-like curve: flat up to 4 tokens, then linear in tokens (compute-bound).
    target = {n: 0.070 * max(1.0, n / 4) for n in range(1, 129)}
    model = CostModel(target, {k: 0.02 * k for k in range(1, 9)})
    policy = AdaptiveLength(model, 8)
    policy.overall.estimate = AcceptanceEstimate.prior(8, 0.7)

    def rows(count):
        return [SimpleNamespace(request_id=f"{count}-{i}", params=SimpleNamespace(seed=None, greedy=True),
                                num_tokens_left=1000, output_ids=[0] * 50) for i in range(count)]

    solo = policy.num_tokens(rows(1), [1])
    pair = policy.num_tokens(rows(2), [1, 1])
    large = policy.num_tokens(rows(16), [1] * 16)
    assert solo[0] >= 2 and 0 < max(pair) < solo[0] and large == [0] * 16
    assert model.batch_step_seconds([solo[0]]) == model.step_seconds(solo[0])  # one row: the solo model


def test_in_a_batch_a_catch_up_must_pay_for_every_row_that_waits():
    """A catch-up worth buying for a request alone is not worth stalling 8 rows for; a long
    enough request buys it in a batch too."""
    model = costs(catch_up=0.005)
    saving = model.step_seconds(0) - model.step_seconds(4) / expected_tokens([0.9] * 4, 4)
    horizon = 2 * model.catch_up_seconds(100) / saving  # earns the catch-up back twice, alone

    def choose(rows, tokens_left):
        controller = GoodputController(model, 4, AcceptanceEstimate.prior(4, 0.9))
        return controller.choose(lag=100, tokens_left=10_000, expected_left=tokens_left, batch_rows=rows)

    assert choose(1, horizon) > 0
    assert choose(8, horizon) == 0
    assert choose(8, 5 * horizon) > 0


def test_the_engine_counts_every_row_of_the_step_as_waiting():
    """Plain rows and other drafters' rows wait for a catch-up too: the policy hears the step's size."""
    from types import SimpleNamespace

    from draftwise.speculative.control.policy import AdaptiveLength

    policy = AdaptiveLength(costs(catch_up=0.005), 4)
    policy.overall.lengths.extend([300] * 8)  # requests run ~300 tokens
    seq = SimpleNamespace(request_id="a", params=SimpleNamespace(seed=None, greedy=True),
                          num_tokens_left=1000, output_ids=[0] * 10)
    assert policy.num_tokens([seq], [100]) != [0]
    assert policy.num_tokens([seq], [100], batch_size=16) == [0]


def test_each_traffic_segment_keeps_its_own_memory():
    """Short translations teach the translation segment not to pay a catch-up; code, in its own
    segment, still does; unlabelled requests use the overall memory, which every request feeds."""
    from types import SimpleNamespace

    from draftwise.speculative.control.policy import AdaptiveLength

    policy = AdaptiveLength(costs(catch_up=0.005), 4)

    def request(name, segment, length):
        return SimpleNamespace(request_id=name, segment=segment, params=SimpleNamespace(seed=None, greedy=True),
                               num_tokens_left=1000 - length, output_ids=[0] * length,
                               finish_reason="length")

    for i in range(6):
        for segment, length in (("translation", 20), ("code", 400)):
            seq = request(f"{segment}{i}", segment, length)
            policy.num_tokens([seq], [1])
            policy.release(seq)
    assert policy.segments["translation"].expected_tokens_left(0) == 20
    assert policy.segments["code"].expected_tokens_left(0) == 400
    assert policy.overall.expected_tokens_left(0) == 210
    translation, code = request("t", "translation", 0), request("c", "code", 0)
    assert policy.num_tokens([translation], [100]) == [0]  # 0.5 s of catch-up for ~20 tokens: no
    assert policy.num_tokens([code], [100])[0] > 0  # for ~400 tokens: yes, at once


def test_a_new_segment_expects_lengths_from_all_traffic_until_it_has_its_own():
    """A segment's first requests buy the catch-up at once where all traffic ran long (no renting),
    and its own lengths take over once it has MIN_LENGTHS of them."""
    from types import SimpleNamespace

    from draftwise.speculative.control.policy import MIN_LENGTHS, AdaptiveLength

    policy = AdaptiveLength(costs(catch_up=0.005), 4)

    def request(name, segment, length):
        return SimpleNamespace(request_id=name, segment=segment, params=SimpleNamespace(seed=None, greedy=True),
                               num_tokens_left=1000 - length, output_ids=[0] * length,
                               finish_reason="length")

    first = request("q0", "qa", 0)
    assert policy.expected_tokens_left(first, 0) is None  # nothing finished anywhere: ski rental
    assert policy.num_tokens([first], [100]) == [0]
    for i in range(MIN_LENGTHS):
        seq = request(f"c{i}", "code", 400)
        policy.num_tokens([seq], [1])
        policy.release(seq)
    assert policy.expected_tokens_left(request("q1", "qa", 0), 0) == 400
    assert policy.num_tokens([request("q2", "qa", 0)], [100])[0] > 0  # bought at the first token
    for i in range(MIN_LENGTHS):
        seq = request(f"qa{i}", "qa", 20)
        policy.num_tokens([seq], [1])
        policy.release(seq)
    assert policy.expected_tokens_left(request("q3", "qa", 0), 0) == 20  # its own lengths now
    assert policy.num_tokens([request("q4", "qa", 0)], [100]) == [0]


def test_slow_start_a_draft_reaches_at_most_twice_the_deepest_position_tried():
    """After one fully accepted draft of 3 the point estimates ask for the longest draft; evidence
    reaches position 3, so the next draft stops at 6, and one accepted to its end doubles it."""
    from draftwise.speculative.control.controller import SLOW_START

    model = costs(per_extra_token=0.001, draft_per_token=0.002)
    controller = GoodputController(model, 8, AcceptanceEstimate.prior(8, 0.9))
    assert best_num_tokens(controller.estimate.effective_rates(), model, 8) == 8
    assert controller.choose() == SLOW_START == 2  # nothing tried yet
    controller.observe(2, 2)
    assert controller.choose() == 4
    controller.observe(3, 3)
    assert controller.choose() == 6
    controller.observe(6, 0)  # rejected at once: the depth tried stays 3
    assert controller.estimate.depth_cap() == 6
    controller.observe(6, 6)
    assert controller.choose() == 8  # the configured bound
    # A new request of a segment that learnt its depths starts at the full depth.
    assert GoodputController(model, 8, controller.estimate.copy()).choose() == 8


def test_a_new_segment_starts_optimistic_whatever_other_traffic_taught():
    """Summaries drove the drafter's overall estimate to ~0; code, a new segment, must still try."""
    from types import SimpleNamespace

    from draftwise.speculative.control.policy import AdaptiveLength

    policy = AdaptiveLength(costs(), 4)
    summary = SimpleNamespace(request_id="s", segment="summarization", params=SimpleNamespace(seed=None, greedy=True),
                              num_tokens_left=1000, output_ids=[])
    for _ in range(50):
        policy.num_tokens([summary], [1])
        policy.observe(summary, 4, 0)
    assert policy.overall.estimate.rates[0] < 0.1
    code = SimpleNamespace(request_id="c", segment="code", params=SimpleNamespace(seed=None, greedy=True),
                           num_tokens_left=1000, output_ids=[])
    assert policy.num_tokens([code], [1])[0] > 0


def test_the_confidence_rule_keeps_thin_evidence_from_drafting(monkeypatch):
    """With the lower-bound rule on, two accepted drafts are not enough to pay for a dear drafter;
    forty are. (Off by default: the point estimate drafts at once.)"""
    from draftwise.speculative.control import controller as module
    from draftwise.speculative.control.controller import confident_num_tokens

    dear = costs(draft_per_token=0.040)  # a drafted token costs 57% of a plain step
    thin, thick = AcceptanceEstimate.prior(4, 0.5), AcceptanceEstimate.prior(4, 0.5)
    for _ in range(2):
        thin.observe(1, 1)
    for i in range(40):
        thick.observe(1, int(i % 10 != 0))  # 90% accepted
    assert confident_num_tokens(thin, dear, 4) > 0  # off: the point estimate decides
    monkeypatch.setattr(module, "CONFIDENCE_Z", 1.0)
    monkeypatch.setattr(module, "DRAFT_MARGIN", 0.02)
    assert thin.lower_bounds()[0] < thin.effective_rates()[0]
    assert confident_num_tokens(thin, dear, 4) == 0 and confident_num_tokens(thick, dear, 4) > 0


def test_a_row_drafting_beside_plain_rows_pays_for_their_padding():
    """A pass pads every row to the widest: one row verifying k drafts beside 7 plain rows costs
    8 x (k + 1) tokens' work (measured: BENCHMARKS.md, "Ragged passes cost their padding"). Where
    that does not pay, the row stays plain in the batch though it drafts alone."""
    from types import SimpleNamespace

    import pytest

    from draftwise.speculative.control.policy import AdaptiveLength

    target = {n: 0.070 * max(1.0, n / 4) for n in range(1, 129)}  # flat up to 4 tokens, then compute-bound
    model = CostModel(target, {k: 0.002 * k for k in range(1, 9)})
    ragged = [4] + [0] * 7
    assert model.batch_step_seconds(ragged) == pytest.approx(model.batch_draft_seconds(ragged) + target[40])
    assert model.batch_step_seconds([4] * 8) == pytest.approx(model.batch_draft_seconds([4] * 8) + target[40])
    policy = AdaptiveLength(model, 8)
    policy.overall.estimate = AcceptanceEstimate.prior(8, 0.7)

    def row(name):
        return SimpleNamespace(request_id=name, params=SimpleNamespace(seed=None, greedy=True),
                               num_tokens_left=1000, output_ids=[0] * 50)

    assert policy.num_tokens([row("alone")], [0])[0] >= 2
    assert policy.num_tokens([row("beside")], [0], batch_size=8) == [0]


def test_where_the_runner_packs_rows_a_drafting_row_pays_only_for_its_own_tokens():
    """The CPU's kernel backends pack a pass's rows one after another (`ModelRunner.pass_tokens`):
    one row verifying k drafts beside 7 plain rows costs k + 8 tokens' work, so the row drafts as
    as far as it would alone; padded, the same row is held to one draft."""
    from types import SimpleNamespace

    import pytest

    from draftwise.speculative.control.policy import AdaptiveLength

    target = {n: 0.070 * max(1.0, n / 16) for n in range(1, 129)}  # flat up to 16 tokens, then compute-bound
    draft = {k: 0.002 * k for k in range(1, 9)}
    packed = CostModel(target, draft, rows_padded=False)
    ragged = [7] + [0] * 7
    assert packed.batch_step_seconds(ragged) == pytest.approx(packed.batch_draft_seconds(ragged) + target[15])

    def row(name):
        return SimpleNamespace(request_id=name, params=SimpleNamespace(seed=None, greedy=True),
                               num_tokens_left=1000, output_ids=[0] * 50)

    chosen = {}
    for rows_padded in (False, True):
        policy = AdaptiveLength(CostModel(target, draft, rows_padded=rows_padded), 8)
        policy.overall.estimate = AcceptanceEstimate.prior(8, 0.7)
        chosen[rows_padded, "alone"] = policy.num_tokens([row("alone")], [0])[0]
        chosen[rows_padded, "beside"] = policy.num_tokens([row("beside")], [0], batch_size=8)[0]
    assert chosen[False, "alone"] == chosen[True, "alone"] >= 2
    assert chosen[False, "beside"] == chosen[False, "alone"]
    assert chosen[True, "beside"] <= 1
