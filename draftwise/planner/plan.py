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
5. With `validate`, run the real engine at the concurrencies that fit here and compare measured
   throughput, and speedup over plain, with the prediction (plain and each drafter, adaptive).

Cost per day: `price_per_mtok` is what a million generated tokens cost today without speculation
(machine time / throughput). Speculation that multiplies throughput by s at the same concurrency
makes the same machines produce them in 1/s of the time, so the cost becomes price / s.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from draftwise.adaptive.cost_model import CostModel
from draftwise.planner.simulate import Acceptance, Policy, Prediction, Request, simulate

PAYS_MARGIN = 1.02  # speculation "pays" when the best config is at least 2% above plain
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


@dataclass(slots=True)
class PlanOptions:
    traffic: str
    model: str = "qwen2.5-coder-1.5b"
    drafters: tuple[str, ...] = ("draft", "ngram")
    draft_model: str = DEFAULT_DRAFT
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    sample: int = 24
    max_tokens: int = 128
    max_k: int = 6
    segment_field: str | None = None
    price_per_mtok: float | None = None
    tokens_per_day: float | None = None
    seed: int = 0
    validate: bool = False
    validate_max_concurrency: int = 4
    draft_context_window: int | None = 128  # as SpeculativeConfig's: bounds the draft model's catch-up


@dataclass(slots=True)
class DrafterFacts:
    method: str
    acceptance: dict[str, dict]  # segment -> {"conditional": [...], "propose_rate": p}
    weights_bytes: int
    kv_bytes_per_token: int


@dataclass(slots=True)
class Plan:
    options: dict
    requests: int
    segments: dict[str, int]
    predictions: dict[str, list[dict]]  # config name -> one Prediction per concurrency
    best: dict[int, dict]  # concurrency -> {"config", "speedup", ...}
    switch_off_at: int | None
    drafters: list[DrafterFacts]
    memory: dict[str, dict]
    cost_per_day: dict[int, dict] | None
    calibration: float = 1.0  # real plain run / simulated plain run at concurrency 1
    validation: list[dict] = field(default_factory=list)


def make_plan(options: PlanOptions, progress=print) -> Plan:
    from draftwise.llm import LLM
    from draftwise.planner.measure import measure_acceptance, plain_requests
    from draftwise.planner.traffic import read_traffic
    from draftwise.spec.config import SpeculativeConfig

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
        acceptance = measure_acceptance(llm, items, _spec(method, options), options.max_k)
        drafter = llm.engine.drafters[method]
        config = SpeculativeConfig.from_value({**_spec(method, options), "num_speculative_tokens": options.max_k})
        costs_by_method[method] = scaled(llm.measure_costs(drafter.proposer, config), calibration)
        acceptance_by_method[method] = acceptance
        drafters.append(DrafterFacts(method, {s: asdict(a) for s, a in acceptance.items()},
                                     *_drafter_memory(drafter.proposer)))
    progress("simulating")
    predictions = predict(plain_costs, costs_by_method, acceptance_by_method, requests, options)
    best, switch_off = recommend(predictions, options.concurrency)
    plan = Plan(asdict(options), len(requests), _segment_counts(requests), predictions, best, switch_off,
                drafters, memory_report(llm, drafters, requests), cost_report(best, options), calibration)
    if options.validate:
        plan.validation = validate(llm, items, requests, plan, options, progress)
    return plan


def scaled(costs: CostModel, factor: float) -> CostModel:
    return CostModel({n: s * factor for n, s in costs.target.items()}, {k: s * factor for k, s in costs.draft.items()},
                     costs.catch_up * factor, costs.key)


def _spec(method: str, options: PlanOptions) -> dict:
    return {"method": method, "model": options.draft_model} if method == "draft" else {"method": method}


def predict(plain_costs, costs_by_method: dict, acceptance_by_method: dict, requests: list[Request],
            options: PlanOptions) -> dict[str, list[dict]]:
    """Every configuration at every concurrency, as JSON-ready dicts."""
    table: dict[str, list[dict]] = {"plain": []}
    for c in options.concurrency:
        table["plain"].append(asdict(simulate(plain_costs, requests, {}, Policy(0), c, seed=options.seed)))
    for method, costs in costs_by_method.items():
        acceptance = acceptance_by_method[method]
        window = options.draft_context_window if method == "draft" else None
        policies = [Policy(options.max_k, adaptive=True)] + [Policy(k) for k in range(1, options.max_k + 1)]
        for policy in policies:
            name = f"{method} {policy.name}"
            table[name] = [asdict(simulate(costs, requests, acceptance, policy, c, catch_up_window=window,
                                           seed=options.seed)) for c in options.concurrency]
    return table


def recommend(predictions: dict[str, list[dict]], levels: tuple[int, ...]) -> tuple[dict[int, dict], int | None]:
    best: dict[int, dict] = {}
    switch_off = None
    for i, c in enumerate(levels):
        plain = predictions["plain"][i]["tokens_per_second"]
        name, point = max(((n, p[i]) for n, p in predictions.items()), key=lambda item: item[1]["tokens_per_second"])
        speedup = point["tokens_per_second"] / plain
        if speedup < PAYS_MARGIN:
            name, point, speedup = "plain", predictions["plain"][i], 1.0
            switch_off = c if switch_off is None else switch_off
        best[c] = {"config": name, "speedup": speedup, "tokens_per_second": point["tokens_per_second"],
                   "latency_p95": point["latency_p95"], "plain_tokens_per_second": plain}
    return best, switch_off


def _drafter_memory(proposer) -> tuple[int, int]:
    """(weights bytes, KV bytes per token) a drafter adds: a draft model's; nothing for n-gram or layer skip."""
    runner = getattr(proposer, "runner", None)
    own_model = runner is not None and type(proposer).__name__ == "DraftModelProposer"
    if not own_model:
        return 0, 0
    from draftwise.model.runner import ModelRunner

    return module_bytes(runner.model), ModelRunner.kv_bytes_per_token(runner.model)


def module_tensors(model: torch.nn.Module):
    """Every tensor a model holds, once each: parameters, buffers and packed weights kept as
    attributes (not those on the meta device)."""
    seen: set[int] = set()
    for module in model.modules():
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for tensor in tensors:
            if id(tensor) not in seen and tensor.device.type != "meta":
                seen.add(id(tensor))
                yield tensor


def module_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor a model holds (`module_tensors`)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in module_tensors(model))


def memory_report(llm, drafters: list[DrafterFacts], requests: list[Request]) -> dict[str, dict]:
    """Per drafter: what it adds, and how many mean-length sequences fit in the target's KV budget
    without it and with it (weights taken from the budget, its KV per token added to each)."""
    from draftwise.model.runner import ModelRunner

    target_kv = ModelRunner.kv_bytes_per_token(llm.model)
    budget = llm.runner.blocks.num_blocks * llm.runner.blocks.block_size * target_kv
    context = sum(r.prompt_tokens + r.output_tokens for r in requests) / max(1, len(requests))
    plain_fit = int(budget // (context * target_kv))
    report = {}
    for facts in drafters:
        with_drafter = int(max(0, budget - facts.weights_bytes) // (context * (target_kv + facts.kv_bytes_per_token)))
        report[facts.method] = {"weights_bytes": facts.weights_bytes, "kv_bytes_per_token": facts.kv_bytes_per_token,
                                "kv_budget_bytes": budget, "mean_context_tokens": context,
                                "sequences_fit_plain": plain_fit, "sequences_fit_with_drafter": with_drafter}
    return report


def cost_report(best: dict[int, dict], options: PlanOptions) -> dict[int, dict] | None:
    if options.price_per_mtok is None or options.tokens_per_day is None:
        return None
    plain = options.tokens_per_day / 1e6 * options.price_per_mtok
    return {c: {"plain_per_day": plain, "with_speculation_per_day": plain / b["speedup"], "config": b["config"]}
            for c, b in best.items()}


def _segment_counts(requests: list[Request]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for request in requests:
        counts[request.segment] = counts.get(request.segment, 0) + 1
    return counts


def validate(llm, items, requests: list[Request], plan: Plan, options: PlanOptions, progress) -> list[dict]:
    """Measured vs predicted: plain, and each drafter adaptive, at the levels that fit here.

    Level by level, plain first and each drafter right after it (this machine drifts by 10-15%
    over tens of minutes, so a speculative run is compared with a plain run of minutes before, not
    of the start). Each run starts from a freshly installed drafter, as a simulation does, and
    passes every request's segment. Rows carry the error on throughput and on the speedup over
    plain at the same level (the ratio cancels the drift that both runs share)."""
    from draftwise.planner.measure import run_closed_loop

    prompts = [item.prompt for item in items]
    segments = [item.segment or None for item in items]
    lengths = [r.output_tokens for r in requests]  # the plain run's lengths: the same tokens, EOS included
    levels = [c for c in options.concurrency if c <= options.validate_max_concurrency]
    rows = []
    for c in levels:
        index = options.concurrency.index(c)
        plain_measured = plain_predicted = None
        for method in ["plain", *options.drafters]:
            name = "plain" if method == "plain" else f"{method} adaptive k<={options.max_k}"
            progress(f"validating {name} at concurrency {c}")
            llm.set_speculative(None if method == "plain" else
                                {**_spec(method, options), "num_speculative_tokens": options.max_k}, progress=False)
            run = run_closed_loop(llm, prompts, lengths, c, segments=segments)
            measured, predicted = run["tokens_per_s"], plan.predictions[name][index]
            if method == "plain":
                plain_measured, plain_predicted = measured, predicted["tokens_per_second"]
            measured_speedup = measured / plain_measured
            predicted_speedup = predicted["tokens_per_second"] / plain_predicted
            rows.append({"config": name, "concurrency": c, "measured_tokens_per_second": measured,
                         "predicted_tokens_per_second": predicted["tokens_per_second"],
                         "error": predicted["tokens_per_second"] / measured - 1,
                         "measured_speedup": measured_speedup, "predicted_speedup": predicted_speedup,
                         "speedup_error": predicted_speedup / measured_speedup - 1,
                         "measured_latency_p95": run["p95"], "predicted_latency_p95": predicted["latency_p95"]})
    return rows


# --- output -------------------------------------------------------------------------------------
def render(plan: Plan) -> str:
    options = plan.options
    lines = [f"Traffic: {options['traffic']} ({plan.requests} sampled requests; segments: "
             + ", ".join(f"{s or '(none)'} {n}" for s, n in plan.segments.items())
             + f"). Calibration: real steps take {plan.calibration:.2f}x the profiled forward passes.", ""]
    lines += ["| concurrency | plain tok/s | plain p95 s | recommended | tok/s | speedup | p95 s |",
              "|---|---|---|---|---|---|---|"]
    for i, c in enumerate(options["concurrency"]):
        b, plain = plan.best[c], plan.predictions["plain"][i]
        lines.append(f"| {c} | {plain['tokens_per_second']:.1f} | {plain['latency_p95']:.1f} | {b['config']} | "
                     f"{b['tokens_per_second']:.1f} | {b['speedup']:.2f}x | {b['latency_p95']:.1f} |")
    lines.append("")
    if plan.switch_off_at is None:
        lines.append("Speculation pays at every concurrency measured.")
    else:
        lines.append(f"Switch speculation off from concurrency {plan.switch_off_at} (no configuration is "
                     f"{PAYS_MARGIN - 1:.0%} above plain there).")
    for method, memory in plan.memory.items():
        lines.append(f"- {method}: adds {memory['weights_bytes'] / 2**20:.0f} MiB of weights and "
                     f"{memory['kv_bytes_per_token'] / 1024:.1f} KiB of KV per token; in this KV budget "
                     f"{memory['sequences_fit_plain']} sequences of {memory['mean_context_tokens']:.0f} tokens fit "
                     f"without it, {memory['sequences_fit_with_drafter']} with it.")
    if plan.cost_per_day:
        lines += ["", "| concurrency | cost/day plain | cost/day with speculation | config |", "|---|---|---|---|"]
        for c, cost in plan.cost_per_day.items():
            lines.append(f"| {c} | {cost['plain_per_day']:.2f} | {cost['with_speculation_per_day']:.2f} | {cost['config']} |")
    if plan.validation:
        lines += ["", "Validation (the real engine on this machine):", "",
                  "| concurrency | config | measured tok/s | predicted tok/s | error | measured speedup | "
                  "predicted speedup | speedup error | measured p95 s | predicted p95 s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row in plan.validation:
            lines.append(f"| {row['concurrency']} | {row['config']} | {row['measured_tokens_per_second']:.2f} | "
                         f"{row['predicted_tokens_per_second']:.2f} | {row['error']:+.1%} | "
                         f"{row['measured_speedup']:.2f}x | {row['predicted_speedup']:.2f}x | "
                         f"{row['speedup_error']:+.1%} | "
                         f"{row['measured_latency_p95']:.1f} | {row['predicted_latency_p95']:.1f} |")
    return "\n".join(lines)


def plot(plan: Plan, path: Path) -> None:
    from draftwise.benchmark.plots import plot_against_concurrency

    names = ["plain"] + [f"{d.method} adaptive k<={plan.options['max_k']}" for d in plan.drafters]
    series = {name: ([p["tokens_per_second"] for p in plan.predictions[name]],
                     [p["latency_p95"] for p in plan.predictions[name]]) for name in names}
    plot_against_concurrency(series, list(plan.options["concurrency"]), path,
                             ("predicted tokens / s", "predicted p95 latency, s"))


def write(plan: Plan, folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / "plan.json", "markdown": folder / "plan.md", "plot": folder / "plan.png"}
    paths["json"].write_text(json.dumps(asdict(plan), indent=1, default=str))
    paths["markdown"].write_text(render(plan) + "\n")
    plot(plan, paths["plot"])
    return paths


__all__ = ["Acceptance", "Plan", "PlanOptions", "Prediction", "make_plan", "render", "write"]
