"""`draftwise plan`: on this traffic, this machine and these concurrencies, will speculation pay?

1. Sample the traffic (evenly across segments) and run it with plain decoding, one request at a
   time: prompt and output lengths, and the time it took.
2. For each drafter, run the sample again at a fixed k to measure acceptance per segment
   (`measure.py`), and load (or measure) the machine's cost model for target and drafter.
3. Calibrate: the cost model times bare forward passes over a 256-token context; a real step also
   samples, schedules and detokenizes, and attends over longer contexts. The plain run of step 1 is
   exactly "plain decoding at concurrency 1", so every cost is scaled by measured / simulated time
   of that run (printed as the calibration factor). Then simulate closed-loop serving at each
   concurrency (`simulate.py`): plain decoding, each drafter adaptive (k <= k_max) and every fixed k.
4. Recommend, per concurrency, the fastest configuration; the concurrency from which speculation
   stops paying (no config 2% above plain); the memory a drafter costs (its weights and KV cache,
   and how many fewer sequences fit in the same KV budget); and the cost per day.
5. With `validate` (`validate.py`), run the real engine at the concurrencies that fit here and compare measured
   throughput, and speedup over plain, with the prediction (plain and each drafter, adaptive).

Cost per day: `price_per_mtok` is what a million generated tokens cost today without speculation
(machine time / throughput). Speculation that multiplies throughput by s at the same concurrency
makes the same machines produce them in 1/s of the time, so the cost becomes price / s.
"""

from __future__ import annotations

from dataclasses import asdict

from draftwise.llm import LLM
from draftwise.planner.measure import measure_acceptance, plain_requests
from draftwise.planner.memory import memory_report
from draftwise.planner.plan import (DrafterFacts, Plan, PlanOptions, cost_report, predict, recommend, scaled,
                                    segment_counts, speculative_dict)
from draftwise.planner.simulate import Policy, simulate
from draftwise.traffic import read_traffic
from draftwise.planner.validate import validate
from draftwise.speculative.config import SpeculativeConfig


def make_plan(options: PlanOptions, progress=print) -> Plan:
    # each drafter is installed when its acceptance is measured (loading the draft model once)
    llm = LLM(options.model, max_num_seqs=max(options.validate_max_concurrency, 1), progress=False)
    items = read_traffic(options.traffic, llm.tokenizer, sample=options.sample, max_tokens=options.max_tokens,
                         seed=options.seed, segment_field=options.segment_field)
    progress(f"plain decoding of {len(items)} sampled requests")
    requests, plain_seconds = plain_requests(llm, items)
    plain_costs = llm.measure_costs(None, None)
    calibration = plain_seconds / simulate(plain_costs, requests, {}, Policy(0), 1, expected=True).seconds
    progress(f"calibration: real steps take {calibration:.2f}x the profiled forward passes")
    plain_costs = scaled(plain_costs, calibration)
    drafters, costs_by_method, acceptance_by_method = [], {}, {}
    for method in options.drafters:
        progress(f"measuring {method} acceptance at k = {options.max_k}")
        acceptance = measure_acceptance(llm, items, speculative_dict(method, options), options.max_k)
        proposer = llm.engine.drafters[method].proposer
        config = SpeculativeConfig.from_value({**speculative_dict(method, options), "num_speculative_tokens": options.max_k})
        costs_by_method[method] = scaled(llm.measure_costs(proposer, config), calibration)
        acceptance_by_method[method] = acceptance
        footprint = proposer.footprint()
        drafters.append(DrafterFacts(method, {s: asdict(a) for s, a in acceptance.items()}, footprint.weights_bytes,
                                     footprint.kv_bytes_per_token, proposer.catch_up_window))
    progress("simulating")
    windows = {facts.method: facts.catch_up_window for facts in drafters}
    predictions = predict(plain_costs, costs_by_method, acceptance_by_method, windows, requests, options)
    best, switch_off = recommend(predictions, options.concurrency)
    plan = Plan(asdict(options), len(requests), segment_counts(requests), predictions, best, switch_off,
                drafters, memory_report(llm, drafters, requests), cost_report(best, options), calibration,
                sample_requests=[asdict(r) for r in requests])
    if options.validate:
        plan.validation = validate(llm, items, requests, plan, options, progress)
    return plan
