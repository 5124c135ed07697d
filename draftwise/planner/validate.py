"""`draftwise plan --validate`: the real engine on this machine against the plan's prediction."""

from __future__ import annotations

from draftwise.planner.plan import Plan, PlanOptions, speculative_dict
from draftwise.planner.simulate import Request


def validate(llm, items, requests: list[Request], plan: Plan, options: PlanOptions, progress) -> list[dict]:
    """Measured vs predicted: plain, and each drafter adaptive, at the levels that fit here.

    Level by level, plain first and each drafter right after it (this machine drifts by 10-15%
    over tens of minutes, so a speculative run is compared with a plain run of minutes before, not
    of the start). Each run starts from a freshly installed drafter, as a simulation does, and
    passes every request's segment. Rows carry the error on throughput and on the speedup over
    plain at the same level (the ratio cancels the drift that both runs share)."""
    from draftwise.llm.closed_loop import run_closed_loop

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
                                {**speculative_dict(method, options), "num_speculative_tokens": options.max_k}, progress=False)
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
