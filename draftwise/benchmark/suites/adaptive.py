"""`--suite adaptive`: each drafter adaptive (k <= 8, the goodput controller choosing k per step)
against the same drafter at a fixed k (`--fixed-k`, default 3), per category of Spec-Bench and
HumanEval, batch 1. Every request carries its category as its traffic segment (the controller keeps
its memory per segment, as the server does for a request's `segment`). Tables: the speculative
suite's, then each adaptive config against the best fixed k of its drafter, per category."""

from __future__ import annotations

from dataclasses import asdict

from draftwise.benchmark.configs import CONTROL, config_method, default_configs, is_adaptive, parse_config
from draftwise.benchmark.report import SuiteReport, control_line, ratio, speedup_tables, table
from draftwise.benchmark.suites import BenchSettings
from draftwise.benchmark.suites.speculative import header, measure_prompts, prompts_for, sampling
from draftwise.benchmark.summary import summarize


def default_adaptive_configs(fixed_k: int) -> list[str]:
    return [config for method in default_configs() for config in (method, f"{method}:k={fixed_k}")]


def run(settings: BenchSettings) -> SuiteReport:
    configs = settings.configs_or(default_adaptive_configs(settings.fixed_k))
    params = sampling(settings, 128)
    prompts = prompts_for(settings, 8, params.max_tokens)
    results = measure_prompts(settings, {name: parse_config(name, settings.options) for name in configs},
                              params, prompts)
    summary = summarize(results, compare_outputs=params.greedy)
    text = "\n\n".join([header(settings, prompts, params) + " Adaptive configs: k chosen per step.",
                        control_line(summary[CONTROL]["all"]["speedup"]), speedup_tables(summary),
                        "Adaptive against the best fixed k of the same drafter (on all prompts): speedup over "
                        "plain, adaptive / fixed, per category:", adaptive_vs_fixed(summary, configs)])
    data = {"summary": summary, "requests": {r.name: [asdict(q) for q in r.requests] for r in results}}
    return SuiteReport("adaptive", text, data)


def adaptive_vs_fixed(summary: dict, configs: list[str]) -> str:
    categories = list(summary[configs[0]])
    rows = []
    for adaptive in (c for c in configs if is_adaptive(c)):
        fixed = [c for c in configs if not is_adaptive(c) and config_method(c) == config_method(adaptive)]
        if not fixed:
            rows.append([adaptive, "none run", *["-"] * len(categories), "-"])
            continue
        best = max(fixed, key=lambda c: summary[c]["all"]["speedup"])
        cells = [f"{ratio(summary[adaptive][c]['speedup'])} / {ratio(summary[best][c]['speedup'])}"
                 for c in categories]
        lowest = min(summary[adaptive][c]["speedup"] for c in categories)
        rows.append([adaptive, best, *cells, ratio(lowest)])
    return table(["adaptive", "best fixed k", *categories, "adaptive, lowest category"], rows)
