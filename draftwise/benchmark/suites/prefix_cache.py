"""`--suite prefix-cache`: requests sharing a long system prompt, with automatic prefix caching off
(the baseline, and its control) and on, batch 1, interleaved request by request.

The workload: one system prompt of about `--max-model-len / 2` tokens of instructions (the README of
a made-up service, repeated to length), then a different Spec-Bench question per request, through
the chat template; greedy, `--max-tokens` (default 32). With caching on, the first request computes
the whole prompt and every later one only what follows the blocks it shares. Reported: time to first
token (median over the requests after the first, and the first's), its ratio to caching off, the
share of prompt tokens found in the cache, and outputs = caching off.

Every config computes prompts with the decoding kernels (`prompt_kernels=False`, the default where
the cache is on): caching off alone would otherwise take the prompt kernels (AMX tiles), whose other
rounding can flip a near-tie (the tiny test model's flat logits did, depending on which layers took
int8 activations), and the comparison would no longer be of caching alone. The prefill suite
measures the prompt kernels.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from draftwise.benchmark.configs import DraftwiseRecipe, LLMRecipe, control_name
from draftwise.benchmark.datasets import _jsonl, _spec_bench_category, data_file
from draftwise.benchmark.probes import EngineStats
from draftwise.benchmark.report import SuiteReport, control_line, ratio, table
from draftwise.benchmark.runner import lineup, run_benchmark
from draftwise.benchmark.suites import BenchSettings
from draftwise.benchmark.suites.speculative import tokenizer_of
from draftwise.sampling.params import SamplingParams

OFF, ON = "caching off", "caching on"
INSTRUCTIONS = ("You answer questions for the support desk of Northwind Rail. Be brief and exact. Tickets are "
                "sold per zone; a day pass covers every zone; children under six travel free; bicycles ride "
                "in the first carriage outside rush hours; refunds take five working days; lost property is "
                "kept for thirty days at the central station. ")


def run(settings: BenchSettings) -> SuiteReport:
    tokenizer = tokenizer_of(settings.model)
    target_tokens = settings.max_model_len // 2
    system = INSTRUCTIONS * max(1, target_tokens // len(tokenizer.encode(INSTRUCTIONS)))
    questions = [row["turns"][0] for row in _jsonl(data_file("spec-bench"))
                 if _spec_bench_category(row["category"]) == "qa"][:settings.per_category or 8]
    items = [("shared", tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                      {"role": "user", "content": question}]))
             for question in questions]
    params = SamplingParams(temperature=0.0, max_tokens=settings.max_tokens or 32)
    base = LLMRecipe(settings.model, max_model_len=settings.max_model_len, prompt_kernels=False)
    recipes = [DraftwiseRecipe(OFF, replace(base, prefix_caching=False), params),
               DraftwiseRecipe(ON, base, params, reference=OFF),
               DraftwiseRecipe(control_name(OFF), replace(base, prefix_caching=False), params, reference=OFF)]
    with lineup(recipes, settings.isolation) as contestants:
        results = run_benchmark(contestants, items + [EngineStats()], warm_up="Hello", progress=settings.progress)
    by_name = {r.name: r for r in results}
    cold = by_name[OFF].requests
    rows, figures = [], {}
    for result in results:
        ttfts = [r.ttft for r in result.requests]
        later = statistics.median(ttfts[1:])
        stats = result.measures[0]
        figures[result.name] = {"ttft_first": ttfts[0], "ttft_later_median": later,
                                "ttft_ratio": later / statistics.median(r.ttft for r in cold[1:]),
                                "hit_share": stats["prefix_cache_hits"] / max(stats["prefix_cache_queries"], 1),
                                "equal": sum(a.token_ids == b.token_ids for a, b in zip(result.requests, cold))}
        f = figures[result.name]
        rows.append([result.name, f"{f['ttft_first']:.2f}", f"{f['ttft_later_median']:.3f}", ratio(f["ttft_ratio"]),
                     f"{f['hit_share']:.0%}", f"{f['equal']}/{len(items)}"])
    prompt_tokens = cold[0].prompt_tokens
    text = "\n\n".join([
        f"{settings.model}: {len(items)} chat requests sharing a system prompt ({prompt_tokens} prompt tokens in "
        f"all for the first), each a different Spec-Bench question, greedy, {params.max_tokens} tokens, batch 1, "
        "interleaved (the first config rotating), each config on its own LLM"
        + (", in its own process" if settings.isolation == "process" else ", all in one process")
        + "; prompts on the decoding kernels in every config (`--prompt-kernels off`: caching alone differs).",
        control_line(figures[control_name(OFF)]["ttft_ratio"], OFF, control_name(OFF),
                     " (median time to first token after the first request)"),
        table(["config", "TTFT first s", "TTFT later (median) s", "vs caching off", "prompt tokens cached",
               "outputs = caching off"], rows)])
    return SuiteReport("prefix-cache", text, {"figures": figures})
