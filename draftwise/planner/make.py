"""`draftwise plan`: on this traffic, this machine and these concurrencies, will speculation pay?

1. Sample the traffic (evenly across segments) and run it with plain decoding, one request at a
   time: prompt and output lengths, and the time it took.
2. For each drafter, run the sample again at a fixed k to measure acceptance per segment and,
   per request, where its drafts were accepted (`measure.py`, replayed by the simulation:
   `replay.py`), and load (or measure) the machine's cost model for target and drafter.
3. Calibrate, per n and per drafter: the profile times bare forward passes over a 256-token
   context, once; the runs of steps 1 and 2 time every real pass. Each profile is the prior of
   live costs (`speculative.control.live_costs`) fed with those runs' steps, so a target pass over
   n tokens costs what such passes cost in the runs, and each drafter's calls what they cost: the
   median over the whole run (`whole_run`), not over its last 16 steps as while serving. (With the
   serving window, held-out traffic's plain pass came out at 60 ms where the drafters' runs
   timed 47-52 ms, plain was predicted 10-12% slower than measured and every speedup too high.)
   The target's passes are one computation whichever drafter runs: one table learns from every
   run's target passes (n = 1 mostly from the plain run, n = k + 1 from the drafters' runs), and
   each drafter adds only its own calls. (With a table per run, each learnt the n it saw and took the
   others from its own profile's shape: after the super-block kernels the pass over one token cost
   41.1 ms in plain's table, 34.4 in the draft model's and 40.3 in prompt lookup's, and every
   speedup was predicted 5-16% too high.)
   Prefills cost what a line fitted to every measuring run's timed prefills says
   (`measure.PrefillCost`: the target's prefill is the same computation whichever drafter runs, and
   one run's prefills alone swung from 6.2 to 8.1 ms a token between two plans on one machine).
   What a decoding step costs beyond its timed pass (scheduling, detokenizing) is one constant:
   the plain run's decoding time (its own timed prefills taken out) minus its simulation without
   prefills, over its steps (printed). (It was one factor applied to everything, which made the
   dearer passes of speculation dearer still: held-out traffic was predicted at 0.83-0.88x where
   the engine measured 0.99-1.15x.) Then simulate closed-loop serving at each concurrency
   (`simulate.py`): plain decoding, each drafter adaptive (k <= k_max) and every fixed k.
4. Recommend, per concurrency, the fastest configuration; the concurrency from which speculation
   stops paying (no config 2% above plain); the memory a drafter costs (its weights and KV cache,
   and how many fewer sequences fit in the same KV budget); and the cost per day.
5. With replica counts (`fleet.py`): the runs above at one replica's thread count, one replica
   simulated at each per-replica share of the clients, summed per replica count; the fewest replicas
   that serve a target load within a latency objective.
6. With `validate` (`validate.py`), run the real engine at the concurrencies that fit here and compare measured
   throughput, and speedup over plain, with the prediction (plain, each drafter adaptive, and the
   recommended configuration), in rounds.

Cost per day: `price_per_mtok` is what a million generated tokens cost today without speculation
(machine time / throughput). Speculation that multiplies throughput by s at the same concurrency
makes the same machines produce them in 1/s of the time, so the cost becomes price / s.
"""

from __future__ import annotations

from dataclasses import asdict, replace

from draftwise.llm import LLM
from draftwise.planner.fleet import FleetOptions, predict_fleet, share_levels
from draftwise.planner.measure import PrefillCost, measure_acceptance, plain_requests
from draftwise.planner.memory import memory_report
from draftwise.planner.plan import (DrafterFacts, Plan, PlanOptions, cost_report, drafter_footprint, predict,
                                    recommend, segment_counts, speculative_dict)
from draftwise.planner.simulate import Policy, simulate
from draftwise.traffic import read_traffic
from draftwise.planner.validate import validate
from draftwise.speculative.config import SpeculativeConfig
from draftwise.speculative.control.cost_model import CostModel
from draftwise.speculative.control.live_costs import LiveCostModel


def make_plan(options: PlanOptions, progress=print) -> Plan:
    if not options.replicas:
        return _make_plan(options, progress)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(options.threads_per_replica)  # the plan's runs are one replica's
    try:
        return _make_plan(options, progress)
    finally:
        torch.set_num_threads(threads)


def _make_plan(options: PlanOptions, progress) -> Plan:
    # each drafter is installed when its acceptance is measured (loading the draft model once). No
    # prefix caching: the plan runs the same sample again and again, which would find its prompts
    # cached where the traffic it stands for would not (the prefills timed would be the cache's). Prompts
    # on the kernels a default server computes them with (with prefix caching: the decoding ones).
    llm = LLM(options.model, max_num_seqs=max(options.validate_max_concurrency, 1), progress=False,
              enable_prefix_caching=False, prompt_kernels=False)
    items = read_traffic(options.traffic, llm.tokenizer, sample=options.sample, max_tokens=options.max_tokens,
                         seed=options.seed, segment_field=options.segment_field)
    for entry in options.drafters:  # a missing or mismatched draft model fails before any run
        llm.check_speculative(speculative_dict(entry, options))
    progress(f"plain decoding of {len(items)} sampled requests")
    # The target's passes, from every run below (plain's profile the prior); each drafter's calls apart.
    live_plain = LiveCostModel(llm.measure_costs(None, None), whole_run=True)
    requests, plain_seconds, plain_prefills = plain_requests(llm, items, live_plain.observe_step)
    prefill_points = list(plain_prefills)
    drafters, live_by_method, acceptance_by_method, replays = [], {}, {}, {}
    for method in options.drafters:
        progress(f"measuring {method} acceptance at k = {options.max_k}")
        config = SpeculativeConfig.from_value({**speculative_dict(method, options), "num_speculative_tokens": options.max_k})

        def listen_to_drafter(method=method, config=config):
            # the drafter's profile is the prior of its calls; its runs' target passes teach the shared table
            live = LiveCostModel(llm.measure_costs(llm.engine.drafters[config.method].proposer, config), whole_run=True)
            live_by_method[method] = live

            def listen(timing) -> None:
                live.observe_step(timing)
                if not timing.is_prefill:
                    live_plain.observe_target(timing.num_tokens, timing.target_seconds)
            return listen

        acceptance, replays[method] = measure_acceptance(llm, items, speculative_dict(method, options),
                                                         options.max_k, listen_to_drafter, prefill_points)
        proposer = llm.engine.drafters[config.method].proposer
        acceptance_by_method[method] = acceptance
        footprint = proposer.footprint()
        drafters.append(DrafterFacts(method, {s: asdict(a) for s, a in acceptance.items()}, footprint.weights_bytes,
                                     footprint.kv_bytes_per_token, proposer.catch_up_window,
                                     [list(m) for m in replays[method].matches]))
    # Prefills are the target's alone, whichever drafter runs: one line through all the runs' prefills.
    prefill = PrefillCost.fit(prefill_points)
    prefill_seconds = prefill.seconds if prefill is not None else None
    simulated = simulate(live_plain, requests, {}, Policy(0), 1, expected=True, prefill_seconds=prefill_seconds).seconds
    calibration = plain_seconds / simulated
    # What a decoding step costs beyond its timed pass: the plain run's decoding time (its own timed
    # prefills taken out) against its simulation without prefills.
    decoding = plain_seconds - sum(seconds for _, seconds in plain_prefills)
    simulated_decoding = simulate(live_plain, requests, {}, Policy(0), 1, expected=True,
                                  prefill_seconds=lambda n: 0.0).seconds
    decoding_steps = sum(r.output_tokens - 1 for r in requests)
    overhead = max(0.0, decoding - simulated_decoding) / decoding_steps if decoding_steps else 0.0
    prefills = (f"; a prefill {prefill.fixed * 1e3:.0f} ms + {prefill.per_token * 1e3:.2f} ms a prompt token "
                f"(fitted to {len(prefill_points)} timed prefills)" if prefill else "")
    progress(f"calibration: a step costs {overhead * 1e3:.1f} ms beyond its timed target pass (the passes "
             f"themselves as timed while running){prefills}")
    plain_costs = live_plain.with_overhead(overhead)
    costs_by_method = {method: with_target(live.with_overhead(overhead), plain_costs)
                       for method, live in live_by_method.items()}
    progress("simulating")
    windows = {facts.method: facts.catch_up_window for facts in drafters}
    predictions = predict(plain_costs, costs_by_method, acceptance_by_method, windows, requests, options, replays,
                          prefill_seconds)
    best, switch_off = recommend(predictions, options.concurrency, drafter_footprint(
        {facts.method: (facts.weights_bytes, facts.kv_bytes_per_token) for facts in drafters}))
    plan = Plan(asdict(options), len(requests), segment_counts(requests), predictions, best, switch_off,
                drafters, memory_report(llm, drafters, requests), cost_report(best, options), calibration,
                sample_requests=[asdict(r) for r in requests], step_overhead_seconds=overhead,
                prefill=asdict(prefill) if prefill else None,
                costs={name: asdict(costs) for name, costs in {"plain": plain_costs, **costs_by_method}.items()})
    if options.replicas:
        plan.fleet = fleet_plan(plain_costs, costs_by_method, acceptance_by_method, windows, requests, options,
                                replays, prefill_seconds)
    if options.validate:
        plan.validation = validate(llm, items, requests, plan, options, progress)
    return plan


def with_target(costs: CostModel, target: CostModel) -> CostModel:
    """A drafter's costs with the shared table of target passes."""
    return CostModel(dict(target.target), dict(costs.draft), costs.catch_up, costs.key, costs.spread, costs.rows_padded)


def fleet_plan(plain_costs, costs_by_method, acceptance_by_method, windows, requests, options: PlanOptions,
               replays, prefill_seconds) -> dict:
    """One replica simulated at every per-replica client count the replica counts need, then summed
    (`fleet.py`)."""
    needed = share_levels(options.concurrency, options.replicas)
    one = predict(plain_costs, costs_by_method, acceptance_by_method, windows, requests,
                  replace(options, concurrency=needed), replays, prefill_seconds)
    by_share = {config: dict(zip(needed, points)) for config, points in one.items()}
    fleet_options = FleetOptions(options.replicas, options.threads_per_replica, options.target_qps, options.slo_p95)
    mean_output = sum(r.output_tokens for r in requests) / len(requests)
    return predict_fleet(by_share, options.concurrency, fleet_options, mean_output)
