"""`--suite speculative` (the default): plain decoding against drafter configs, batch 1, over the same
prompts (Spec-Bench, HumanEval or JSONL; `datasets.py`), with peers (`--peers hf`) measured in the
same run or shown as not run. Tables: speedup and outputs = plain per category, tau per category,
acceptance, time drafting and latency; plots: speedup by category, acceptance by position, speedup
vs k (fixed-k configs). The adaptive suite runs through the same `measure_prompts`."""

from __future__ import annotations

import math

import sys
from dataclasses import asdict
from pathlib import Path

from draftwise.benchmark.background_load import BackgroundLoad
from draftwise.benchmark.configs import (CONFIG_PATTERN, CONTROL, PLAIN, LLMRecipe, default_configs, parse_config,
                                         recipes)
from draftwise.benchmark.datasets import load_prompts
from draftwise.benchmark.peers import peer_recipes
from draftwise.benchmark.report import SuiteReport, control_line, speedup_tables
from draftwise.benchmark.runner import ConfigResult, Prompt, lineup, run_benchmark
from draftwise.benchmark.suites import BenchSettings
from draftwise.benchmark.summary import summarize
from draftwise.errors import InvalidParameterError
from draftwise.loading.registry import DEFAULT_DRAFT
from draftwise.plots import bar_chart, line_chart
from draftwise.sampling.params import SamplingParams

DATASETS = ("spec-bench", "humaneval")


def tokenizer_of(model: str):
    """The target's tokenizer, without building an LLM here (the configs' processes build theirs)."""
    from draftwise.loading.resolve import resolve_model
    from draftwise.text.tokenizer import Tokenizer

    return Tokenizer(resolve_model(model, progress=True))


def prompts_for(settings: BenchSettings, per_category: int, max_tokens: int,
                datasets: tuple[str, ...] = DATASETS) -> list[Prompt]:
    """(category, prompt) pairs of every dataset in turn, `per_category` of each category."""
    tokenizer = tokenizer_of(settings.model)
    prompts: list[Prompt] = []
    for dataset in settings.datasets or datasets:
        prompts += load_prompts(dataset, tokenizer, per_category=settings.per_category or per_category,
                                all_turns=settings.all_turns, max_tokens=max_tokens, seed=settings.seed)
    if not prompts:
        raise InvalidParameterError("no prompts: the datasets gave none")
    return prompts


def measure_prompts(settings: BenchSettings, named: dict[str, dict | None], params: SamplingParams,
                    prompts: list[Prompt], extra: list | None = None, probes: list | None = None) -> list[ConfigResult]:
    """Plain decoding, each named config (a speculative dict), the control and `extra` recipes (peers),
    over `prompts` and then `probes`, interleaved, each in its own process unless told otherwise."""
    base = LLMRecipe(settings.model, max_model_len=settings.max_model_len)
    print(f"building plain, {len(named)} configs, the control" + (" and the peers" if extra else ""),
          file=sys.stderr, flush=True)
    load = BackgroundLoad.parse(settings.background_load) if settings.background_load else None
    with lineup(recipes(base, named, params) + (extra or []), settings.isolation) as contestants:
        return run_benchmark(contestants, prompts + (probes or []), progress=settings.progress, load=load)


def sampling(settings: BenchSettings, max_tokens: int, **overrides) -> SamplingParams:
    return SamplingParams(**{"temperature": settings.temperature, "max_tokens": settings.max_tokens or max_tokens,
                             "seed": settings.seed, **overrides})


def header(settings: BenchSettings, prompts: list[Prompt], params: SamplingParams) -> str:
    counts: dict[str, int] = {}
    for category, _ in prompts:
        counts[category] = counts.get(category, 0) + 1
    where = "each config in its own process" if settings.isolation == "process" else "every config in one process"
    load = ""
    if settings.background_load:
        parsed = BackgroundLoad.parse(settings.background_load)
        load = (f" {parsed.processes} busy process(es) ran beside it from prompt "
                f"{math.ceil(parsed.start_fraction * len(prompts)) + 1} of {len(prompts)} to the end.")
    return (f"{settings.model}: {len(prompts)} prompts ({', '.join(f'{c} {n}' for c, n in counts.items())}), up to "
            f"{params.max_tokens} tokens, temperature {params.temperature}, seed {params.seed}, batch 1; configs "
            f"interleaved prompt by prompt (the first rotating), {where}.{load}")


def run(settings: BenchSettings) -> SuiteReport:
    configs = settings.configs_or(default_configs())
    params = sampling(settings, 128)
    prompts = prompts_for(settings, 10, params.max_tokens)
    draft_model = next((o["model"] for o in settings.options.values() if o.get("model")), None) or DEFAULT_DRAFT
    peers, absent = peer_recipes(settings.peers, settings.model, draft_model, params.max_tokens)
    named = {name: parse_config(name, settings.options) for name in configs}
    results = measure_prompts(settings, named, params, prompts, peers)
    summary = summarize(results, compare_outputs=params.greedy)
    text = "\n\n".join([header(settings, prompts, params), control_line(summary[CONTROL]["all"]["speedup"]),
                        speedup_tables(summary, absent)])
    data = {"summary": summary, "absent": absent,
            "requests": {r.name: [asdict(q) for q in r.requests] for r in results}}
    return SuiteReport("speculative", text, data, plot_speedups(summary, settings.output))


def plot_speedups(summary: dict, folder: Path) -> dict[str, Path]:
    """Speedup by category, acceptance by position, and speedup vs k of the fixed-k configs."""
    configs = [name for name in summary if name != PLAIN]
    categories = list(summary[PLAIN])
    paths = {"speedup by category": folder / "speedup_by_category.png",
             "acceptance by position": folder / "acceptance_by_position.png",
             "speedup vs k": folder / "speedup_vs_k.png"}
    bar_chart(categories, {name: [summary[name][c]["speedup"] for c in categories] for name in configs},
              paths["speedup by category"], "speedup over plain")
    rates = {name: summary[name]["all"]["acceptance_by_position"] for name in configs}
    line_chart({name: (list(range(1, len(r) + 1)), r) for name, r in rates.items() if r},
               paths["acceptance by position"], "draft position", "acceptance rate", ylim=(0, 1.05))
    by_method: dict[str, list[tuple[int, float]]] = {}
    for name in configs:
        match = CONFIG_PATTERN.match(name)
        if match and match.group(2) == "=":
            by_method.setdefault(match.group(1), []).append((int(match.group(3)), summary[name]["all"]["speedup"]))
    line_chart({method: ([k for k, _ in sorted(points)], [s for _, s in sorted(points)])
                for method, points in by_method.items()}, paths["speedup vs k"], "k (fixed)", "speedup over plain",
               baseline=1.0)
    return paths
