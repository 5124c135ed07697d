"""The serving simulator behind `draftwise plan`: the closed-form speedup it must reproduce, and
the cases where it must predict no gain."""

import random

import pytest
import torch

from draftwise.speculative.control.cost_model import CostModel
from draftwise.planner.simulate import Acceptance, Policy, Request, leviathan_speedup, simulate

STEP = 0.05  # seconds of one target step


def flat_costs(cost_ratio: float, growth: float = 0.0) -> CostModel:
    """Verification of n tokens costs STEP * (1 + growth * (n - 1)); a drafted token cost_ratio * STEP."""
    target = {n: STEP * (1 + growth * (n - 1)) for n in range(1, 65)}
    draft = {k: k * cost_ratio * STEP for k in range(1, 9)}
    return CostModel(target, draft)


def speedup(costs, acceptance, policy, concurrency=1, requests=None, expected=True, seed=0):
    requests = requests or [Request(1, 20000, "code")]
    plain = simulate(costs, requests, acceptance, Policy(0), concurrency, expected=expected, seed=seed)
    spec = simulate(costs, requests, acceptance, policy, concurrency, expected=expected, seed=seed)
    return spec.tokens_per_second / plain.tokens_per_second, spec


@pytest.mark.parametrize("alpha,k,c", [(0.8, 4, 0.1), (0.6, 2, 0.3), (0.9, 8, 0.05), (0.5, 1, 0.5)])
def test_batch_one_constant_acceptance_reproduces_leviathan(alpha, k, c):
    acceptance = {"code": Acceptance((alpha,) * 8)}
    ratio, _ = speedup(flat_costs(c), acceptance, Policy(k))
    assert ratio == pytest.approx(leviathan_speedup(alpha, k, c), rel=2e-3)


def test_sampled_acceptance_converges_to_the_closed_form():
    acceptance = {"code": Acceptance((0.7,) * 8)}
    ratio, _ = speedup(flat_costs(0.2), acceptance, Policy(3), expected=False, seed=3)
    assert ratio == pytest.approx(leviathan_speedup(0.7, 3, 0.2), rel=0.03)


def test_no_gain_predicted_when_verification_grows_as_fast_as_tokens():
    acceptance = {"code": Acceptance((0.9,) * 8)}
    costs = flat_costs(0.1, growth=1.0)  # n tokens cost n steps: nothing is saved by verifying together
    fixed, _ = speedup(costs, acceptance, Policy(4))
    adaptive, run = speedup(costs, acceptance, Policy(8, adaptive=True))
    assert fixed < 1.0
    # the engine's controller stays plain but for its probes, which may cost up to 2%
    assert adaptive == pytest.approx(1.0, abs=0.02) and run.mean_k < 0.05


def test_adaptive_backs_off_as_the_batch_grows():
    """Verification gets expensive once batch x (k + 1) passes ~8 tokens: drafting pays alone, not at 16."""
    target = {n: STEP * (1 if n <= 8 else n / 8) for n in range(1, 65)}
    costs = CostModel(target, {k: 0.05 * k * STEP for k in range(1, 9)})
    acceptance = {"chat": Acceptance((0.8,) * 8)}
    rng = random.Random(0)
    requests = [Request(rng.randint(20, 60), rng.randint(50, 150), "chat") for _ in range(48)]
    alone, run_alone = speedup(costs, acceptance, Policy(8, adaptive=True), 1, requests)
    crowded, run_crowded = speedup(costs, acceptance, Policy(8, adaptive=True), 16, requests)
    assert alone > 1.5 and run_alone.mean_k > 2
    assert crowded == pytest.approx(1.0, abs=0.02) and run_crowded.mean_k < 0.2


def test_a_row_whose_drafter_finds_nothing_costs_a_plain_row():
    """Prompt lookup without a match drafts nothing: the engine takes a plain step for that row, and
    so must the simulation (charging k verified tokens for it under-predicted adaptive prompt lookup
    by 12-18% on held-out traffic)."""
    costs = flat_costs(0.0, growth=0.3)  # verification dear, drafting free
    never = {"code": Acceptance((1.0,) * 8, propose_rate=0.0)}
    assert speedup(costs, never, Policy(4))[0] == pytest.approx(1.0)
    half = {"code": Acceptance((1.0,) * 8, propose_rate=0.5)}
    ratio, _ = speedup(costs, half, Policy(4), requests=[Request(1, 4000, "code")])
    # half the steps commit 5 tokens for 1 + 0.3 * 4 steps, the others 1 token for 1 step
    assert ratio == pytest.approx((0.5 * 5 + 0.5) / (0.5 * 2.2 + 0.5), rel=0.05)


def test_every_request_finishes_and_latency_percentiles_are_ordered():
    rng = random.Random(1)
    requests = [Request(rng.randint(5, 50), rng.randint(1, 40), rng.choice(["a", "b"])) for _ in range(30)]
    acceptance = {"a": Acceptance((0.9, 0.8, 0.7)), "b": Acceptance((0.2,), propose_rate=0.5)}
    for concurrency in (1, 4, 32):
        run = simulate(flat_costs(0.2, 0.1), requests, acceptance, Policy(3, adaptive=True), concurrency, seed=2)
        assert run.requests == (len(requests) if concurrency <= len(requests) else 2 * concurrency)
        assert 0 < run.ttft_p50 <= run.ttft_p95 and run.latency_p50 <= run.latency_p95
        assert run.ttft_p95 <= run.latency_p95 + 1e-9


def test_more_clients_than_sampled_requests_are_served_the_sample_again():
    """Six sampled requests cannot keep 24 clients busy: served once over, c = 24 repeated c = 6's
    figures under another label. The sample is served again until each client sent two requests,
    so a pass whose cost barely grows with its rows yields more at 24 rows than at 6."""
    requests = [Request(10, 30 + 5 * i, "a") for i in range(6)]
    costs = flat_costs(0.2, 0.01)
    at_sample = simulate(costs, requests, {}, Policy(0), 6, expected=True)
    above = simulate(costs, requests, {}, Policy(0), 24, expected=True)
    assert at_sample.requests == 6 and above.requests == 48
    assert above.tokens_per_second > 2 * at_sample.tokens_per_second


def test_plan_end_to_end_on_a_tiny_model(tiny_qwen, tmp_path, monkeypatch):
    """Traffic file in, recommendation, memory, cost, validation and files out (tiny model, seconds).
    Time is a fake clock that moves only when a model runs, so every measurement is exact."""
    import json

    from draftwise.planner.make import make_plan
    from draftwise.planner.plan import PlanOptions
    from draftwise.planner.report import render, write
    from draftwise.speculative.control.profile import PROFILES_ENV
    from tests.clocks import WorkClock

    monkeypatch.setenv(PROFILES_ENV, str(tmp_path / "profiles"))  # profiles measured on the fake clock stay here
    WorkClock(monkeypatch, "draftwise.speculative.control.profile", "draftwise.engine.sequence",
              "draftwise.engine.engine", "draftwise.llm.closed_loop")

    traffic = tmp_path / "traffic.jsonl"
    rows = [{"prompt": "def add(a, b):", "segment": "code"}, {"prompt": "for i in range(3):", "segment": "code"},
            {"messages": [{"role": "user", "content": "hello there"}], "segment": "chat", "max_tokens": 12},
            {"turns": ["say something"], "category": "chat"}]
    traffic.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    options = PlanOptions(str(traffic), model=str(tiny_qwen), drafters=("draft", "ngram"),
                          drafter_options={"draft": {"model": str(tiny_qwen)}},
                          concurrency=(1, 2, 8), sample=4, max_tokens=16, max_k=3, price_per_mtok=10.0,
                          tokens_per_day=2e6, validate=True, validate_max_concurrency=2, validate_rounds=2,
                          replicas=(1, 2), threads_per_replica=1, target_qps=0.01)
    threads = torch.get_num_threads()
    plan = make_plan(options, progress=lambda line: None)
    assert torch.get_num_threads() == threads  # (the plan ran at one replica's count, then gave them back)
    assert plan.fleet["best"][2][8]["shares"] == [4, 4] and plan.fleet["target"]["replicas"] == 1
    assert "| replicas | clients |" in render(plan)
    assert plan.requests == 4 and plan.segments == {"code": 2, "chat": 2}
    # one table of target passes, learnt from every run, in every configuration's costs
    assert all(plan.costs[method]["target"] == plan.costs["plain"]["target"] for method in ("draft", "ngram"))
    # The clock charges what the profile measured, so the simulated plain run takes just as long as the real one.
    assert plan.calibration == pytest.approx(1.0)
    assert set(plan.predictions) >= {"plain", "draft adaptive k<=3", "ngram k=3"}
    # the target drafting for itself: everything is accepted
    assert all(rate == 1.0 for rate in plan.drafters[0].acceptance["code"]["conditional"])
    # and a draft made at any output position would have been accepted to the end of its request
    for matches, request in zip(plan.drafters[0].matches, plan.sample_requests):
        assert list(matches) == [-1] + [request["output_tokens"] - p - 1 for p in range(1, request["output_tokens"])]
    assert plan.memory["draft"]["weights_bytes"] > 0 and plan.memory["ngram"]["weights_bytes"] == 0
    assert plan.memory["draft"]["sequences_fit_with_drafter"] < plan.memory["draft"]["sequences_fit_plain"]
    assert set(plan.best) == {1, 2, 8} and plan.cost_per_day[1]["plain_per_day"] == 20.0
    validated = {(row["config"], row["concurrency"]) for row in plan.validation}
    base = {(name, c) for name in ("plain", "draft adaptive k<=3", "ngram adaptive k<=3") for c in (1, 2)}
    # plain and the adaptive drafters, and the recommended configuration where it is another
    assert validated - base == {(plan.best[c]["config"], c) for c in (1, 2)} - base and base <= validated
    for row in plan.validation:  # speedups against plain at the same level, measured right before
        assert row["measured_speedup"] > 0 and row["predicted_speedup"] > 0 and row["rounds"] == 2
        low, high = row["measured_speedup_range"]
        assert low <= row["measured_speedup"] <= high
        if row["config"] == "plain":
            assert row["measured_speedup"] == row["predicted_speedup"] == 1.0
            assert row["predicted_tokens_per_second"] == pytest.approx(row["measured_tokens_per_second"])
    paths = write(plan, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["requests"] == 4
    assert paths["plot"].stat().st_size > 0 and "| concurrency |" in render(plan)
    assert "Target pass over n tokens, relative to one (as timed here): n=2 " in render(plan)

    # The same plan predicted again with another device's costs (`draftwise plan --from-plan --costs`):
    # where verification and drafting are free, the target drafting for itself pays; where a pass
    # costs as many steps as it has tokens, nothing does.
    from draftwise.planner.on_device import predict_on_device, render_device_prediction
    from draftwise.speculative.control.cost_model import CostModel

    for folder, costs in (("free", CostModel({1: 0.01, 64: 0.01}, {1: 0.0, 8: 0.0})),
                          ("linear", CostModel({1: 0.01, 64: 0.64}, {1: 0.01, 8: 0.08}))):
        for name in ("plain", "draft", "ngram"):
            costs.write(tmp_path / folder / f"{name}.json")
    free = predict_on_device(paths["json"], tmp_path / "free")
    assert free.best[1]["config"].startswith("draft") and free.best[1]["speedup"] > 2 and not free.missing
    # (a validated plan's levels above validate_max_concurrency are free to predict: nothing is validated)
    assert set(predict_on_device(paths["json"], tmp_path / "free", concurrency=(16, 64)).best) == {16, 64}
    linear = predict_on_device(paths["json"], tmp_path / "linear")
    assert all(b["config"] == "plain" for b in linear.best.values()) and linear.switch_off_at == 1
    (tmp_path / "free" / "ngram.json").unlink()
    partial = predict_on_device(paths["json"], tmp_path / "free")
    assert partial.missing == ["ngram"] and "Not predicted" in render_device_prediction(partial)
    from draftwise.cli import main

    assert main(["plan", "--from-plan", str(paths["json"]), "--costs", str(tmp_path / "free"),
                 "--output", str(tmp_path / "device")]) == 0
    assert "Best per concurrency" in (tmp_path / "device" / "device-plan.md").read_text()
    assert main(["plan", "--from-plan", str(paths["json"])]) != 0  # --costs is needed too: a clear error


def test_the_plan_prices_passes_as_its_runs_timed_them_not_as_the_profile_says(tiny_qwen, tmp_path, monkeypatch):
    """The cached profile is only the prior: a profile 1.3x dearer than the passes the plan's runs
    time (a fake clock: 10 ms + 1 ms a token) leaves the plan's tables at the timed costs, for the
    passes the runs made (1 token: plain; k + 1: the drafter's)."""
    import json

    from draftwise.llm.llm import LLM
    from draftwise.planner.make import make_plan
    from draftwise.planner.plan import PlanOptions
    from tests.clocks import WorkClock

    clock = WorkClock(monkeypatch, "draftwise.speculative.control.profile", "draftwise.engine.sequence",
                      "draftwise.engine.engine", "draftwise.llm.closed_loop")
    prior = CostModel({n: 1.3 * clock.cost(n) for n in range(1, 17)}, {k: 0.0 for k in range(1, 9)})
    monkeypatch.setattr(LLM, "measure_costs", lambda self, proposer, config: prior)
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("\n".join(json.dumps({"prompt": p, "segment": "code"}) for p in (
        "def add(a, b): return a + b\ndef add(a, b):", "for i in range(3): print(i)\nfor i in range(3):")) + "\n")
    options = PlanOptions(str(traffic), model=str(tiny_qwen), drafters=("ngram",), concurrency=(1,), sample=2,
                          max_tokens=24, max_k=3)
    plan = make_plan(options, progress=lambda line: None)
    for table in (plan.costs["plain"]["target"], plan.costs["ngram"]["target"]):
        assert table[1] == pytest.approx(clock.cost(1)) and table[1] < prior.target[1] / 1.2
    assert plan.costs["plain"]["target"][4] == pytest.approx(clock.cost(4))  # ngram's k = 3 verifications


def test_validation_pools_rounds_each_against_its_own_plain_run(monkeypatch):
    """Each round's drafter run is divided by that round's plain run; a row is the median of its
    rounds; the recommended fixed k runs beside the adaptive drafters."""
    import types

    import draftwise.llm.closed_loop as closed_loop
    from draftwise.planner.plan import Plan, PlanOptions
    from draftwise.planner.validate import measured_fastest, validate

    speeds = {"plain": [10.0, 12.0, 11.0], "ngram adaptive": [11.0, 15.0, 12.0],  # per config, one per round
              "ngram k=2": [10.0, 12.0, 11.0]}
    order, installed = [], {}

    def set_speculative(spec, progress):
        installed["name"] = ("plain" if spec is None else
                             f"ngram k={spec['num_speculative_tokens']}" if spec.get("adaptive") is False
                             else "ngram adaptive")
        order.append(installed["name"])

    def fake_run(llm_, prompts, lengths, c, segments=None):
        return {"tokens_per_s": speeds[installed["name"]].pop(0), "p95": 1.0}

    monkeypatch.setattr(closed_loop, "run_closed_loop", fake_run)
    options = PlanOptions("t.jsonl", drafters=("ngram",), concurrency=(1,), max_k=3, validate_rounds=3)
    point = {"tokens_per_second": 10.0, "latency_p95": 1.0}
    predictions = {"plain": [point], "ngram adaptive k<=3": [{**point, "tokens_per_second": 11.5}],
                   "ngram k=2": [{**point, "tokens_per_second": 12.0}]}
    plan = Plan({}, 1, {}, predictions, {1: {"config": "ngram k=2"}}, None, [], {}, None)
    items = [types.SimpleNamespace(prompt="p", segment="")]
    llm = types.SimpleNamespace(set_speculative=set_speculative)
    plain, ngram, fixed = validate(llm, items, [Request(4, 8)], plan, options, progress=lambda line: None)
    assert order == ["plain", "ngram adaptive", "ngram k=2"] * 3  # rounds: plain, then each config
    assert plain["measured_tokens_per_second"] == 11.0 and plain["measured_speedup"] == 1.0
    assert plain["measured_speedup_range"] == pytest.approx([10 / 11, 12 / 11])
    # rounds: 11/10, 15/12, 12/11 -> median 1.1 (not the ratio of the median speeds, 12/11)
    assert ngram["measured_speedup"] == pytest.approx(1.1)
    assert ngram["measured_speedup_range"] == pytest.approx([12 / 11, 1.25])
    assert ngram["speedup_error"] == pytest.approx(1.15 / 1.1 - 1)
    assert fixed["config"] == "ngram k=2" and fixed["measured_speedup"] == pytest.approx(1.0)
    assert measured_fastest([plain, ngram, fixed]) == {1: "ngram adaptive k<=3"}


def test_two_configs_of_one_drafter_are_weighed_side_by_side(tiny_qwen, random_draft, tmp_path, monkeypatch):
    """`--drafters draft,draft:model=OTHER`: each entry is measured with its own options and keeps its
    own label in every table (the target drafting for itself accepts everything, a random draft model
    far less)."""
    import json

    from draftwise.planner.make import make_plan
    from draftwise.planner.plan import PlanOptions
    from draftwise.speculative.control.profile import PROFILES_ENV
    from tests.clocks import WorkClock

    monkeypatch.setenv(PROFILES_ENV, str(tmp_path / "profiles"))
    WorkClock(monkeypatch, "draftwise.speculative.control.profile", "draftwise.engine.sequence",
              "draftwise.engine.engine", "draftwise.llm.closed_loop")
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("\n".join(json.dumps({"prompt": p}) for p in ("def add(a, b):", "for i in range(3):")) + "\n")
    other = f"draft:model={random_draft}"
    options = PlanOptions(str(traffic), model=str(tiny_qwen), drafters=("draft", other),
                          drafter_options={"draft": {"model": str(tiny_qwen)}, other: {"model": str(tiny_qwen)}},
                          concurrency=(1, 2), sample=2, max_tokens=12, max_k=3)
    plan = make_plan(options, progress=lambda line: None)
    assert [facts.method for facts in plan.drafters] == ["draft", other]
    itself, random = (facts.acceptance[""]["conditional"][0] for facts in plan.drafters)
    assert itself == 1.0 and random < 0.5  # the entry's model= won over the options given to every draft
    assert {"draft adaptive k<=3", f"{other} adaptive k<=3", f"{other} k=2"} <= set(plan.predictions)
    assert set(plan.memory) == {"draft", other}


@pytest.mark.parametrize("drafters, message", [
    (("draft:no_such_option=1",), "unknown option.*no_such_option"),
    (("draft:model",), "name=value"),
    (("ngram", "ngram"), "listed twice"),
    (("nope:x=1",), "method must be one of"),
])
def test_plan_refuses_bad_drafter_entries(drafters, message):
    from draftwise.errors import InvalidParameterError
    from draftwise.planner.plan import PlanOptions

    with pytest.raises(InvalidParameterError, match=message):
        PlanOptions("t.jsonl", drafters=drafters)


def test_plan_rejects_bad_traffic(tmp_path, tiny_qwen):
    from draftwise.errors import InvalidParameterError
    from draftwise.traffic import read_traffic
    from draftwise.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny_qwen)
    with pytest.raises(InvalidParameterError, match="not found"):
        read_traffic(tmp_path / "missing.jsonl", tokenizer, sample=4, max_tokens=8)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(InvalidParameterError, match=r"bad.jsonl:2: needs a \"prompt\""):
        read_traffic(bad, tokenizer, sample=4, max_tokens=8)
    bad.write_text('{"prompt": "ok"\n')
    with pytest.raises(InvalidParameterError, match="not JSON"):
        read_traffic(bad, tokenizer, sample=4, max_tokens=8)


def test_draft_model_catch_up_is_charged_once_per_backlog_and_capped_by_the_window():
    costs = flat_costs(0.2)
    costs.catch_up = 0.01
    acceptance = {"code": Acceptance((0.8,) * 8)}
    requests = [Request(500, 50, "code")]
    free = simulate(flat_costs(0.2), requests, acceptance, Policy(3), 1, expected=True)
    charged = simulate(costs, requests, acceptance, Policy(3), 1, expected=True)
    windowed = simulate(costs, requests, acceptance, Policy(3), 1, expected=True, catch_up_window=100)
    assert charged.seconds - free.seconds == pytest.approx(0.01 * 500)  # the prompt (+1 new token, minus 1)
    assert windowed.seconds - free.seconds == pytest.approx(0.01 * 99)


def test_replicas_split_the_clients_and_sum_what_each_serves():
    from draftwise.planner.fleet import FleetOptions, predict_fleet, share_levels, shares

    assert shares(8, 3) == [3, 3, 2] and shares(1, 2) == [1] and shares(8, 1) == [8]
    assert share_levels((1, 8), (1, 2)) == (1, 4, 8)

    def point(tokens_per_second, p95):
        return {"tokens_per_second": tokens_per_second, "latency_p95": p95}

    # one replica: throughput saturates past 4 clients, latency grows with them
    one = {"plain": {1: point(10, 1.0), 4: point(30, 2.0), 8: point(32, 4.0)},
           "ngram k=2": {1: point(14, 0.8), 4: point(33, 1.9), 8: point(33, 4.2)}}
    fleet = predict_fleet(one, (1, 8), FleetOptions((1, 2), 1, target_qps=1.0, slo_p95=2.5, cores=8),
                          mean_output_tokens=32)
    two_at_8 = fleet["best"][2][8]
    assert two_at_8["config"] == "ngram k=2" and two_at_8["tokens_per_second"] == 66 and two_at_8["shares"] == [4, 4]
    assert fleet["best"][2][1]["tokens_per_second"] == 14  # (one client: the other replica idles)
    # 1 request/s = 32 tokens/s within 2.5 s: one replica cannot (33 tokens/s only at p95 4.2 s), two can
    assert fleet["target"]["replicas"] == 2 and fleet["target"]["latency_p95"] <= 2.5
    assert predict_fleet(one, (8,), FleetOptions((1,), 1, target_qps=5.0), 32)["target"] is None


def test_replicas_that_do_not_fit_the_cores_share_them():
    """Two replicas of one thread on 2 cores share them with the serving stack: each gets (2 - SERVING_CORES)
    / 2 of its thread's time, its throughput scaled down and its latency up; one replica, or the same two
    on 8 cores, are not scaled."""
    from draftwise.planner.fleet import SERVING_CORES, FleetOptions, predict_fleet

    one = {"plain": {4: {"tokens_per_second": 30.0, "latency_p95": 2.0}, 8: {"tokens_per_second": 40.0,
                                                                             "latency_p95": 3.0}}}
    small = predict_fleet(one, (8,), FleetOptions((1, 2), 1, cores=2), 32)["best"]
    share = (2 - SERVING_CORES) / 2
    assert small[1][8]["tokens_per_second"] == 40.0 and small[1][8]["core_share"] == 1.0
    assert small[2][8]["tokens_per_second"] == pytest.approx(60.0 * share)
    assert small[2][8]["latency_p95"] == pytest.approx(2.0 / share)
    large = predict_fleet(one, (8,), FleetOptions((1, 2), 1, cores=8), 32)["best"]
    assert large[2][8]["tokens_per_second"] == 60.0 and large[2][8]["core_share"] == 1.0


def test_a_target_load_needs_replica_counts():
    from draftwise.errors import InvalidParameterError
    from draftwise.planner.plan import PlanOptions

    with pytest.raises(InvalidParameterError, match="needs --replicas"):
        PlanOptions("t.jsonl", drafters=("ngram",), target_qps=2.0)
    with pytest.raises(InvalidParameterError, match="at least 1"):
        PlanOptions("t.jsonl", drafters=("ngram",), replicas=(0, 2))
