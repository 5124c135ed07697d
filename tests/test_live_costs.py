"""Costs learned while serving, contaminated profiles, and a controller that stops losing fast.
Every time here is injected (synthetic cost models, a fake clock charging each forward pass): the
tests assert on decisions, never on this machine's speed."""

import math
import random
from types import SimpleNamespace

import pytest

from draftwise import LLM, SamplingParams
from draftwise.speculative.control import profile
from draftwise.speculative.control.controller import AcceptanceEstimate, GoodputController
from draftwise.speculative.control.cost_model import CostModel
from draftwise.speculative.control.live_costs import DRAFT_WINDOW, PRIOR_FAR, WINDOW, LiveCostModel


def synthetic(plain=0.070, per_token=0.010, draft_per_token=0.010, spread=1.0) -> CostModel:
    return CostModel({n: plain + (n - 1) * per_token for n in (1, 2, 3, 4, 5, 8, 16, 32, 64)},
                     {k: k * draft_per_token for k in range(1, 9)}, spread=spread)


def test_live_costs_follow_a_lasting_change_within_half_a_window_and_ignore_outliers():
    live = LiveCostModel(synthetic())
    assert live.target_seconds(4) == pytest.approx(0.100)  # the prior, before any evidence
    for step in range(40):
        live.observe_target(1, 0.070 if step % 10 else 0.700)  # quiet, one descheduled step in ten
    assert live.target_seconds(1) == pytest.approx(0.070)
    for step in range(WINDOW // 2 + 1):  # the machine gets busy: every pass takes 3x
        live.observe_target(1, 0.210)
        live.observe_target(4, 0.300)
    assert live.target_seconds(1) == pytest.approx(0.210) and live.target_seconds(4) == pytest.approx(0.300)
    assert live.target_seconds(16) == pytest.approx(3 * 0.220)  # unseen n move with the median ratio of all
    table = [live.target_seconds(n) for n in sorted(live.target)]
    assert table == sorted(table)  # non-decreasing in n


def test_the_planners_whole_run_costs_are_the_median_of_every_step_not_the_last_window():
    """A measured run's requests decode at many context lengths; the planner simulates all of them,
    so its costs are the run's, not its last WINDOW steps' (which are the serving controller's)."""
    serving, planner = LiveCostModel(synthetic()), LiveCostModel(synthetic(), whole_run=True)
    for seconds in [0.140] * (2 * WINDOW) + [0.070] * WINDOW:  # long contexts first, then a short one
        serving.observe_target(1, seconds)
        planner.observe_target(1, seconds)
    assert serving.target_seconds(1) == pytest.approx(0.070)
    assert planner.target_seconds(1) == pytest.approx(0.140)
    for _ in range(3 * DRAFT_WINDOW):
        planner.observe_draft([2], 0.040)
    planner.observe_draft([2], 0.020)
    assert planner.draft_seconds(2) == pytest.approx(0.040)


def test_whole_run_medians_are_exact_and_cost_nothing_at_any_length():
    """The planner's ratios are kept in order as they come: the median of every one so far, exactly
    as statistics.median gives it (odd and even counts), without re-sorting the run at each step."""
    import statistics

    from draftwise.speculative.control.live_costs import Ratios

    draw, ratios, seen = random.Random(5), Ratios(None), []
    for _ in range(301):
        seen.append(draw.uniform(0.5, 2.0))
        ratios.append(seen[-1])
        assert ratios.median() == statistics.median(seen)
    assert ratios.lower_quartile() == sorted(seen)[len(seen) // 4]
    windowed = Ratios(WINDOW)
    for value in seen:
        windowed.append(value)
    assert len(windowed) == WINDOW and windowed.median() == statistics.median(seen[-WINDOW:])


def test_live_costs_stay_monotone_in_n_whatever_the_noise_says():
    live = LiveCostModel(synthetic())
    for _ in range(5):
        live.observe_target(2, 0.050)  # two tokens measured cheaper than the prior's one-token step
        live.observe_target(1, 0.072)
    assert live.target_seconds(2) >= live.target_seconds(1)


def test_a_drafter_that_slows_down_is_seen_in_its_live_costs():
    live = LiveCostModel(synthetic())
    for _ in range(DRAFT_WINDOW):
        live.observe_draft([3], 0.030 * 5)
    assert live.draft_seconds(3) == pytest.approx(0.150) and live.draft_seconds(1) == pytest.approx(0.050)


def test_a_catch_up_is_learnt_from_the_calls_that_absorbed_a_backlog():
    prior = synthetic()
    prior.catch_up = 0.004
    live = LiveCostModel(prior)
    assert live.catch_up_seconds(101) == pytest.approx(0.400)
    live.observe_draft([2], 0.020 + 100 * 0.006, lags=[101])  # drafted 2 (as profiled) after reading 100 tokens at 6 ms
    assert live.catch_up_seconds(101) == pytest.approx(0.600)  # one catch-up is evidence enough
    assert live.draft_seconds(2) == pytest.approx(0.020)  # and says nothing about drafting
    for _ in range(DRAFT_WINDOW):
        live.observe_draft([1], 0.020)  # the drafter turns 2x dearer: a timed catch-up still stands
    assert live.draft_seconds(1) == pytest.approx(0.020) and live.catch_up_seconds(101) == pytest.approx(0.600)
    assert live.summary()["catch_up_per_token"] == {"prior": 0.004, "live": pytest.approx(0.006), "samples": 1}


def test_a_prior_far_from_the_live_plain_step_is_dropped_from_the_cache(tmp_path):
    path = tmp_path / "profile.json"
    synthetic().write(path)
    live = LiveCostModel(synthetic(), path)
    for _ in range(WINDOW):
        live.observe_target(1, 0.070 * (PRIOR_FAR + 0.5))
    assert live.prior_dropped and not path.exists()
    steady = LiveCostModel(synthetic(), tmp_path / "other.json")
    synthetic().write(tmp_path / "other.json")
    for _ in range(WINDOW):
        steady.observe_target(1, 0.075)
    assert not steady.prior_dropped and (tmp_path / "other.json").exists()


def test_a_quiet_profile_is_kept_though_real_steps_spread_above_it(tmp_path):
    """The profile's points are the fastest of their repeats; real steps spread above them (long
    contexts, the sampler): a window whose median is past PRIOR_FAR but whose fast end is near the
    profile keeps it. A busy machine slows every step, and that drops it (the test above)."""
    path = tmp_path / "profile.json"
    synthetic().write(path)
    live = LiveCostModel(synthetic(), path)
    spread = [1.0, 1.1, 1.2, 1.55, 1.6, 1.7, 1.8, 1.6]
    assert sorted(spread)[len(spread) // 2] > PRIOR_FAR
    for i in range(WINDOW):
        live.observe_target(1, synthetic().target_seconds(1) * spread[i % len(spread)])
    assert not live.prior_dropped and path.exists()


def test_a_contaminated_profile_is_measured_again_and_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(profile.PROFILES_ENV, str(tmp_path))
    assert profile.contamination(synthetic()) is None
    assert "apart" in profile.contamination(synthetic(spread=2.0))
    non_monotone = synthetic()
    non_monotone.target[2] = 0.5 * non_monotone.target[1]  # a 2-token pass cheaper than a 1-token one
    assert "below" in profile.contamination(non_monotone)

    key = "test-key"
    runner = SimpleNamespace()
    measured = []

    def measure_with(outcomes):
        def fake_measure(*args):
            model = outcomes[min(len(measured), len(outcomes) - 1)]
            measured.append(model)
            return CostModel(dict(model.target), dict(model.draft), spread=model.spread)
        return fake_measure

    busy, quiet = synthetic(spread=1.8), synthetic()
    quiet.target = {n: t * 1.01 for n, t in quiet.target.items()}
    result = profile.load_or_measure(key, runner, None, None, 0, measure_with=measure_with([busy, quiet]))
    assert len(measured) == 2 and result.spread == 1.0  # measured again: the second came out clean
    assert CostModel.read(profile.profile_path(key)).spread == 1.0  # and only that one was cached

    profile.profile_path(key).write_text(synthetic(spread=3.0).to_json().replace('"key": ""', f'"key": "{key}"'))
    measured.clear()
    result = profile.load_or_measure(key, runner, None, None, 0, measure_with=measure_with([synthetic(spread=1.6),
                                                                                            synthetic(spread=1.4)]))
    assert len(measured) == profile.MEASURE_ATTEMPTS  # a contaminated cache is not trusted; nor is any attempt
    assert result.spread == 1.4 and CostModel.read(profile.profile_path(key)).spread == 3.0  # nothing cached


def test_a_request_whose_drafts_are_never_accepted_stops_drafting_within_two_steps():
    """The optimistic prior drafts; two rejections end it; afterwards the estimate's drift toward
    its (decaying) long-run mean and the probes draft now and then, ever more rarely: after 100
    steps no more often than the probes' first interval allows."""
    costs = synthetic()
    controller = GoodputController(costs, 4, AcceptanceEstimate.prior(4))
    choices = []
    for _ in range(200):
        k = controller.choose()
        choices.append(k)
        controller.observe(k, 0)
    assert choices[0] > 0 and choices[2] == 0
    first = controller._first_interval
    assert sum(k > 0 for k in choices[100:]) <= math.ceil(100 / first)
    assert sum(k > 0 for k in choices) <= 20  # of 200 steps


def test_a_step_cost_change_mid_run_moves_k_within_a_bounded_number_of_steps():
    """Acceptance 0.9 i.i.d.; the drafter's calls get 8x dearer halfway (the machine got busy where
    the drafter runs). The live costs see it, and k falls to 0 within a window of steps; when the
    drafter is cheap again, drafting resumes."""
    prior = synthetic(draft_per_token=0.008)
    live = LiveCostModel(prior)
    controller = GoodputController(live, 4, AcceptanceEstimate.prior(4, 0.9))
    rng = random.Random(0)
    history = []
    for step in range(300):
        slow = 8.0 if 100 <= step < 200 else 1.0
        k = controller.choose()
        accepted = 0
        while accepted < k and rng.random() < 0.9:
            accepted += 1
        controller.observe(k, accepted)
        live.observe_target(k + 1, prior.target_seconds(k + 1))
        if k:
            live.observe_draft([k], prior.draft_seconds(k) * slow)
        history.append(k)
    assert sum(k >= 2 for k in history[50:100]) > 45  # drafting pays: long drafts
    stopped = next(i for i in range(100, 200) if all(k == 0 for k in history[i:i + 5]))
    assert stopped - 100 <= WINDOW  # k = 0 within a window of the change (probes aside)
    assert sum(k > 0 for k in history[stopped:200]) <= 8  # only probes while it is dear
    assert any(k >= 2 for k in history[200:300])  # cheap again: the probes find out, drafting resumes


class StepClock:
    """Time passes only when a model runs, at a price per runner: the target's passes cost
    `fixed + per_token * n`, the draft model's `draft_factor` times that."""

    def __init__(self, monkeypatch, target_runner, modules):
        from draftwise.runner.model_runner import ModelRunner

        self.now, self.draft_factor, self.target_runner = 0.0, 1.0, target_runner
        forward = ModelRunner.forward

        def ticking_forward(runner, rows, token_ids, *args, **kwargs):
            cost = 0.010 + 0.0005 * sum(len(ids) for ids in token_ids)
            self.now += cost if runner is self.target_runner else 0.05 * cost * self.draft_factor
            return forward(runner, rows, token_ids, *args, **kwargs)

        monkeypatch.setattr(ModelRunner, "forward", ticking_forward)
        for module in modules:
            monkeypatch.setattr(f"{module}.time", SimpleNamespace(perf_counter=lambda: self.now))


def test_the_engine_learns_costs_while_serving_and_stops_drafting_when_they_change(tiny_qwen, tmp_path,
                                                                                 monkeypatch):
    """The target drafting for itself (every draft accepted) with a cheap draft model: adaptive
    speculation drafts. The draft model's passes then get 40x dearer (its share of the machine
    collapses): the engine's live costs see it within a few steps and the controller stops
    drafting, though every draft would still be accepted. Nothing else tells it."""
    monkeypatch.setenv(profile.PROFILES_ENV, str(tmp_path / "profiles"))
    llm = LLM(str(tiny_qwen), max_model_len=512, max_num_seqs=1, progress=False, speculative=None)
    clock = StepClock(monkeypatch, llm.runner, ["draftwise.speculative.control.profile", "draftwise.engine.engine",
                                               "draftwise.engine.sequence"])
    llm.set_speculative({"method": "draft", "model": str(tiny_qwen), "num_speculative_tokens": 4,
                         "draft_vocab_size": None, "draft_context_window": None}, progress=False)
    costs = llm.engine.drafters["draft"].costs
    assert isinstance(costs, LiveCostModel)
    llm.add_request("def add(a, b):", SamplingParams(temperature=0, max_tokens=240, ignore_eos=True))
    ks, changed_at = [], None
    while llm.has_unfinished_requests():
        llm.step()
        ks.append(llm.engine.last_num_tokens.get("draft", 0))
        if changed_at is None and len(ks) >= 25:
            changed_at, clock.draft_factor = len(ks), 40.0
    assert sum(k > 0 for k in ks[5:25]) >= 15  # cheap drafts of a perfect drafter: it drafts
    after = ks[changed_at:]
    stopped = next(i for i in range(len(after)) if all(k == 0 for k in after[i:i + 4]))
    assert stopped <= WINDOW and costs.draft_seconds(1) > 10 * costs.prior.draft_seconds(1)
    stats = llm.engine_stats()
    assert 0 < stats["drafting_steps"] < stats["decode_steps"] and stats["predicted_over_observed"]


def test_drafting_resets_the_plain_steps_a_probe_counts():
    """A probe's budget is a share of the plain steps since drafting last: after a drafting stretch
    the count starts again, so the first plain step that follows is no probe."""
    controller = GoodputController(synthetic(), 4, AcceptanceEstimate.prior(4, 0.0))
    interval = controller._interval
    assert [controller.choose() for _ in range(interval - 1)] == [0] * (interval - 1)  # one short of a probe
    controller.estimate = AcceptanceEstimate.prior(4, 0.95)
    for _ in range(20):
        k = controller.choose()
        assert k > 0
        controller.observe(k, k)
    controller.estimate = AcceptanceEstimate.prior(4, 0.0)
    assert controller.choose() == 0  # (counting from drafting's end: not yet a probe)


def test_an_aborted_or_failed_request_is_no_answer_length():
    """Lengths of finished answers forecast how long a request runs (the horizon a catch-up must pay
    back in); a client that went away or a failure says nothing about that."""
    from draftwise.speculative.control.policy import AdaptiveLength

    policy = AdaptiveLength(synthetic(), 4)
    for i, (length, reason) in enumerate([(3, "abort"), (2, "error"), (40, "stop"), (60, "length")]):
        seq = SimpleNamespace(request_id=str(i), segment=None, params=SimpleNamespace(seed=None, greedy=True),
                              num_tokens_left=100, output_ids=[0] * length, finish_reason=reason)
        policy.num_tokens([seq], [1])
        policy.release(seq)
    assert list(policy.overall.lengths) == [40, 60]


def test_a_draft_call_charges_no_catch_up_for_rows_that_drafted_nothing(tiny_qwen, tmp_path, monkeypatch):
    """A row renting plain steps keeps its backlog; the call of the rows that drafted is timed
    without it (else the live catch-up cost is learnt as about zero)."""
    monkeypatch.setenv(profile.PROFILES_ENV, str(tmp_path / "profiles"))
    llm = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=2, progress=False,
              speculative={"method": "draft", "model": str(tiny_qwen), "num_speculative_tokens": 3,
                           "draft_vocab_size": None, "draft_context_window": None})
    drafter = llm.engine.drafters["draft"]
    monkeypatch.setattr(drafter.draft_length, "num_tokens",
                        lambda seqs, lags, batch_size=None: [3] + [0] * (len(seqs) - 1))
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.add_request("def add(a, b):", greedy)
    llm.step()  # (the prompt)
    renting = llm._live[llm.add_request("x" * 40, greedy)]  # its row drafts nothing: its backlog stays
    for _ in range(4):  # (its prompt's step, then a decoding step of both rows)
        llm.step()
        call = llm.engine._draft_calls.get("draft")
        if call is not None and len(call.num_tokens) == 2:
            break
    assert sorted(zip(call.num_tokens, call.lags))[0] == (0, 0) and max(call.num_tokens) > 0
    assert drafter.proposer.lag(renting) > 2


def test_current_k_of_a_drafter_without_rows_is_zero_not_its_last_value(tiny_qwen):
    llm = LLM(str(tiny_qwen), max_model_len=128, progress=False,
              speculative={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    llm.prepare_drafter("suffix")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    suffix = llm.add_request("a b a b a b a b", long, speculative={"method": "suffix", "num_speculative_tokens": 3})
    for _ in range(20):
        llm.step()
        if llm.engine_stats()["current_k"].get("suffix"):
            break
    assert llm.engine_stats()["current_k"]["suffix"] > 0
    llm.abort_request(suffix)
    llm.add_request("a b a b a b a b", greedy)  # (the LLM's ngram alone)
    llm.step()
    llm.step()
    assert llm.engine_stats()["current_k"]["suffix"] == 0.0
