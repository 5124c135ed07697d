"""`draftwise plan --validate`: the real engine on this machine against the plan's prediction."""

from __future__ import annotations

import statistics

from draftwise.planner.plan import Plan, PlanOptions, speculative_dict
from draftwise.planner.simulate import Policy, Request


def validate(llm, items, requests: list[Request], plan: Plan, options: PlanOptions, progress) -> list[dict]:
    """Measured vs predicted: plain, and each drafter adaptive, at the levels that fit here.

    Level by level, in `options.validate_rounds` rounds: plain first and each drafter right after
    it, so a speculative run is compared with a plain run of minutes before (this machine drifts by
    10-15% over tens of minutes) and each round gives one speedup per drafter. One round of 8
    requests swung by more than the +/-10% a prediction is judged by (BENCHMARKS.md, the planner
    sections), so a row reports the median over rounds (throughput, and each round's speedup) and
    the range of the speedups: a speedup error inside that range is noise, not the model's miss.
    The plain row's range is each round's plain run over the median plain run (the run's own noise).
    The recommended configuration runs too where it is a fixed k (the adaptive ones always run), so
    the report can say whether what it recommends was measured fastest. Each run starts from a
    freshly installed drafter, as a simulation does, and passes every request's segment."""
    from draftwise.llm.closed_loop import run_closed_loop

    prompts = [item.prompt for item in items]
    segments = [item.segment or None for item in items]
    lengths = [r.output_tokens for r in requests]  # the plain run's lengths: the same tokens, EOS included
    levels = [c for c in options.concurrency if c <= options.validate_max_concurrency]
    adaptive = {f"{method} {Policy(options.max_k, adaptive=True).name}":
                {**speculative_dict(method, options), "num_speculative_tokens": options.max_k}
                for method in options.drafters}
    rows = []
    for c in levels:
        index = options.concurrency.index(c)
        configs = {"plain": None, **adaptive, **recommended_config(plan.best[c]["config"], options)}
        measured: dict[str, list[dict]] = {name: [] for name in configs}  # name -> one run per round
        for round_number in range(1, options.validate_rounds + 1):
            for name, speculative in configs.items():
                progress(f"validating {name} at concurrency {c} (round {round_number} of {options.validate_rounds})")
                llm.set_speculative(speculative, progress=False)
                measured[name].append(run_closed_loop(llm, prompts, lengths, c, segments=segments))
        plain_runs = [run["tokens_per_s"] for run in measured["plain"]]
        plain_predicted = plan.predictions["plain"][index]["tokens_per_second"]
        for name, runs in measured.items():
            speeds = [run["tokens_per_s"] for run in runs]
            if name == "plain":
                speedups = [speed / statistics.median(plain_runs) for speed in speeds]
            else:
                speedups = [speed / plain for speed, plain in zip(speeds, plain_runs)]
            predicted = plan.predictions[name][index]
            measured_speed = statistics.median(speeds)
            measured_speedup = 1.0 if name == "plain" else statistics.median(speedups)
            predicted_speedup = predicted["tokens_per_second"] / plain_predicted
            rows.append({"config": name, "concurrency": c, "rounds": len(runs),
                         "measured_tokens_per_second": measured_speed,
                         "predicted_tokens_per_second": predicted["tokens_per_second"],
                         "error": predicted["tokens_per_second"] / measured_speed - 1,
                         "measured_speedup": measured_speedup, "predicted_speedup": predicted_speedup,
                         "speedup_error": predicted_speedup / measured_speedup - 1,
                         "measured_speedup_range": [min(speedups), max(speedups)],
                         "measured_latency_p95": statistics.median(run["p95"] for run in runs),
                         "predicted_latency_p95": predicted["latency_p95"]})
    return rows


def recommended_config(name: str, options: PlanOptions) -> dict[str, dict]:
    """The recommended configuration as {name: speculative dict} when validation would not run it
    anyway (a fixed k: `simulate.Policy` names it "METHOD k=K"), so that what the plan recommends is
    measured beside what it was chosen over; else {}."""
    method, _, policy = name.partition(" k=")
    if method not in options.drafters or not policy.isdigit():
        return {}
    return {name: {**speculative_dict(method, options), "num_speculative_tokens": int(policy), "adaptive": False}}


def measured_fastest(validation: list[dict]) -> dict[int, str]:
    """Concurrency -> the configuration the validation measured fastest (by median speedup)."""
    fastest: dict[int, tuple[str, float]] = {}
    for row in validation:
        best = fastest.get(row["concurrency"])
        if best is None or row["measured_speedup"] > best[1]:
            fastest[row["concurrency"]] = (row["config"], row["measured_speedup"])
    return {c: name for c, (name, _) in fastest.items()}
