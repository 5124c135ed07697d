"""`--suite concurrency`: plain decoding against speculation under continuous batching, closed loop.

At concurrency c there are always c requests in flight through the engine (`LLM.add_request` /
`LLM.step`; a finished one is replaced at once by the next prompt) until `--requests` have finished
(`draftwise.llm.closed_loop`). Prompts: Spec-Bench first turns (2 per category) and HumanEval, the
same for every config and level, each request carrying its category as its traffic segment; greedy.
Level by level, LOOP_ROUNDS rounds, every config in turn within a round (the first rotating), each
on its own LLM: this machine's speed drifts by a third within minutes, and one loop per config and
level left the plain-vs-plain control at 1.32x (BENCHMARKS.md, "Concurrency after packed passes").
Per config and level, the rounds pooled: generated tokens per second over the loops' wall time, the
speedup over plain at the same level (`summary.speedup`), each round's tokens/s, latency p50 / p95,
TTFT p50, and outputs = plain; and a plot of throughput and p95 latency against concurrency.
"""

from __future__ import annotations

from draftwise.benchmark.configs import CONTROL, PLAIN, LLMRecipe, config_recipes, default_configs
from draftwise.benchmark.probes import ClosedLoop
from draftwise.benchmark.report import SuiteReport, control_line, ratio, table
from draftwise.benchmark.runner import lineup, run_benchmark
from draftwise.benchmark.suites import BenchSettings
from draftwise.benchmark.suites.speculative import prompts_for
from draftwise.benchmark.summary import speedup
from draftwise.llm.closed_loop import merge_rounds
from draftwise.plots import plot_against_concurrency
from draftwise.sampling.params import SamplingParams

LEVELS = (1, 2, 4, 8, 16)
LOOP_ROUNDS = 2


def run(settings: BenchSettings) -> SuiteReport:
    levels = list(settings.levels or LEVELS)
    max_tokens = settings.max_tokens or 128
    prompts = prompts_for(settings, 2, max_tokens)[:settings.requests]
    configs = settings.configs_or(default_configs())
    base = LLMRecipe(settings.model, max_num_seqs=max(levels), max_model_len=settings.max_model_len)
    items = [ClosedLoop(c, tuple(p for _, p in prompts), tuple(s for s, _ in prompts), max_tokens)
             for c in levels for _ in range(LOOP_ROUNDS)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    with lineup(config_recipes(base, configs, params, settings.options), settings.isolation) as contestants:
        results = run_benchmark(contestants, items, warm_up=prompts[0][1], progress=settings.progress)
    points = {r.name: {c: merge_rounds(r.measures[i * LOOP_ROUNDS:(i + 1) * LOOP_ROUNDS]) for i, c in enumerate(levels)}
              for r in results}
    for by_level in points.values():
        for c, point in by_level.items():
            base_point = points[PLAIN][c]
            point["speedup"] = speedup(point["tokens"], point["seconds"], base_point["tokens"], base_point["seconds"])
            point["equal_to_plain"] = sum(a == b for a, b in zip(point["outputs"], base_point["outputs"]))
    rows = [[name, c, f"{p['tokens_per_s']:.1f}", ratio(p["speedup"]), " / ".join(f"{x:.1f}" for x in p["rounds"]),
             f"{p['p50']:.1f}", f"{p['p95']:.1f}", f"{p['ttft_p50']:.2f}", f"{p['equal_to_plain']}/{len(p['outputs'])}"]
            for name, by_level in points.items() for c, p in by_level.items()]
    control = max((points[CONTROL][c]["speedup"] for c in levels), key=lambda s: abs(s - 1))
    text = "\n\n".join([
        f"{settings.model}: {len(prompts)} requests per level and round, greedy, up to {max_tokens} new tokens; c "
        "requests in flight at all times, each labelled with its category as its traffic segment. Level by level, "
        f"{LOOP_ROUNDS} rounds, the configs in turn within a round (the first rotating), the rounds pooled; each "
        "config on its own LLM"
        + (", in its own process." if settings.isolation == "process" else ", all in one process."),
        control_line(control, where=" at the level where it strayed furthest from 1.00x"),
        table(["config", "concurrency", "tokens/s", "vs plain", "tokens/s by round", "latency p50 s",
               "latency p95 s", "TTFT p50 s", "outputs = plain"], rows)])
    path = settings.output / "concurrency.png"
    series = {name: ([by_level[c]["tokens_per_s"] for c in levels], [by_level[c]["p95"] for c in levels])
              for name, by_level in points.items()}
    plot_against_concurrency(series, levels, path, ("generated tokens / s", "p95 request latency, s"),
                             f"{settings.model}: continuous batching")
    return SuiteReport("concurrency", text, {"levels": levels, "points": points},
                       {"throughput and p95 latency vs concurrency": path})
