"""The plan as a user reads it: a Markdown report, a JSON file and a plot."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from draftwise.planner.fleet import FleetOptions, render_fleet
from draftwise.planner.plan import PAYS_MARGIN, TIE_MARGIN, Plan
from draftwise.planner.simulate import Policy
from draftwise.planner.validate import measured_fastest
from draftwise.plots import plot_against_concurrency


def render(plan: Plan) -> str:
    options = plan.options
    lines = [f"Traffic: {options['traffic']} ({plan.requests} sampled requests; segments: "
             + ", ".join(f"{s or '(none)'} {n}" for s, n in plan.segments.items())
             + f"). Calibration: costs as timed while running (per n and drafter), plus "
             f"{plan.step_overhead_seconds * 1e3:.1f} ms per step beyond the timed pass.", ""]
    lines += ["| concurrency | plain tok/s | plain p95 s | recommended | tok/s | speedup | p95 s |",
              "|---|---|---|---|---|---|---|"]
    for i, c in enumerate(options["concurrency"]):
        b, plain = plan.best[c], plan.predictions["plain"][i]
        lines.append(f"| {c} | {plain['tokens_per_second']:.1f} | {plain['latency_p95']:.1f} | {b['config']} | "
                     f"{b['tokens_per_second']:.1f} | {b['speedup']:.2f}x | {b['latency_p95']:.1f} |")
    lines.append("")
    ties = [f"- concurrency {c}: predicted within {TIE_MARGIN - 1:.0%} of the fastest, so not told apart: "
            f"{', '.join(b['tied'])}; recommended the one adding the least memory (an adaptive k before a fixed one)."
            for c, b in plan.best.items() if len(b.get("tied", [])) > 1]
    lines += ties + ([""] if ties else [])
    if plan.switch_off_at is None:
        lines.append("Speculation pays at every concurrency measured.")
    else:
        lines.append(f"Switch speculation off from concurrency {plan.switch_off_at} (no configuration is "
                     f"{PAYS_MARGIN - 1:.0%} above plain there).")
    plain_costs = plan.costs.get("plain", {}).get("target")
    if plain_costs:  # what verifying more tokens costs here (a mixture of experts wakes more experts)
        one = float(plain_costs.get("1", plain_costs.get(1, 0)) or 0)
        points = sorted((int(n), float(s)) for n, s in plain_costs.items())
        if one > 0:
            lines.append("Target pass over n tokens, relative to one (as timed here): "
                         + ", ".join(f"n={n} {s / one:.2f}" for n, s in points if n in (2, 4, 8, 16)) + ".")
    for method, memory in plan.memory.items():
        lines.append(f"- {method}: adds {memory['weights_bytes'] / 2**20:.0f} MiB of weights and "
                     f"{memory['kv_bytes_per_token'] / 1024:.1f} KiB of KV per token; in this KV budget "
                     f"{memory['sequences_fit_plain']} sequences of {memory['mean_context_tokens']:.0f} tokens fit "
                     f"without it, {memory['sequences_fit_with_drafter']} with it.")
    if plan.cost_per_day:
        lines += ["", "| concurrency | cost/day plain | cost/day with speculation | config |", "|---|---|---|---|"]
        for c, cost in plan.cost_per_day.items():
            lines.append(f"| {c} | {cost['plain_per_day']:.2f} | {cost['with_speculation_per_day']:.2f} | {cost['config']} |")
    if plan.fleet:
        lines += render_fleet(plan.fleet, FleetOptions(tuple(options["replicas"]), options["threads_per_replica"],
                                                       options.get("target_qps"), options.get("slo_p95")))
    if plan.validation:
        rounds = plan.validation[0].get("rounds", 1)
        lines += ["", f"Validation (the real engine on this machine; medians of {rounds} rounds, each a plain run "
                  "then each drafter; the range is the rounds' speedups, the plain row's each plain run over "
                  "their median):", "",
                  "| concurrency | config | measured tok/s | predicted tok/s | error | measured speedup | "
                  "range | predicted speedup | speedup error | measured p95 s | predicted p95 s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in plan.validation:
            low, high = row.get("measured_speedup_range", [row["measured_speedup"]] * 2)
            lines.append(f"| {row['concurrency']} | {row['config']} | {row['measured_tokens_per_second']:.2f} | "
                         f"{row['predicted_tokens_per_second']:.2f} | {row['error']:+.1%} | "
                         f"{row['measured_speedup']:.2f}x | {low:.2f}-{high:.2f}x | {row['predicted_speedup']:.2f}x | "
                         f"{row['speedup_error']:+.1%} | "
                         f"{row['measured_latency_p95']:.1f} | {row['predicted_latency_p95']:.1f} |")
        lines.append("")
        for c, name in measured_fastest(plan.validation).items():
            tied = plan.best[c].get("tied", [])
            among = (f" (one of the {len(tied)} predicted within {TIE_MARGIN - 1:.0%})" if name in tied
                     and name != plan.best[c]["config"] and len(tied) > 1 else "")
            lines.append(f"- concurrency {c}: recommended {plan.best[c]['config']}; measured fastest {name}{among}.")
    return "\n".join(lines)


def plot(plan: Plan, path: Path) -> None:
    names = ["plain"] + [f"{d.method} {Policy(plan.options['max_k'], adaptive=True).name}" for d in plan.drafters]
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
