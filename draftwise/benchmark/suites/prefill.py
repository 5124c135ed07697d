"""`--suite prefill`: prompts of growing length computed with the prompt kernels off (the baseline,
and its control) and on (`model/prompt_pass.py`: AMX tiles where the CPU has them), prefix caching
off so that every request computes its whole prompt; batch 1, interleaved request by request.

The workload: HumanEval prompts joined to about 150, 400, 800 and 1,600 tokens (those that fit
`--max-model-len`), `--per-category` prompts of each length (default 2), `--max-tokens` greedy
tokens each (default 8). Reported per length: prefill speed (prompt tokens per second of time to
first token) and its ratio to the baseline, and outputs = the baseline's. The two kernels round
differently, so equal outputs are not required: each config is lossless against its own plain
decoding (tests/test_prompt_kernels.py). Their quality: perplexity of `--eval-tokens` tokens of
draftwise's own source, teacher-forced as prompts are computed, and how often the top-1 token
equals the baseline's.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from draftwise.benchmark.configs import DraftwiseRecipe, LLMRecipe, control_name
from draftwise.benchmark.datasets import _jsonl, data_file
from draftwise.benchmark.probes import TeacherForced
from draftwise.benchmark.report import SuiteReport, control_line, ratio, table
from draftwise.benchmark.runner import lineup, run_benchmark
from draftwise.benchmark.suites import BenchSettings
from draftwise.benchmark.suites.quantization import PACKAGE, SAMPLE_FILES
from draftwise.benchmark.suites.speculative import tokenizer_of
from draftwise.errors import InvalidParameterError
from draftwise.quant.native import amx_tiles_here
from draftwise.sampling.params import SamplingParams

OFF, ON = "prompt kernels off", "prompt kernels on"
LENGTHS = (150, 400, 800, 1600)  # prompt tokens, about


def run(settings: BenchSettings) -> SuiteReport:
    tokenizer = tokenizer_of(settings.model)
    params = SamplingParams(temperature=0.0, max_tokens=settings.max_tokens or 8)
    items = prompts_by_length(tokenizer, settings.per_category or 2, settings.max_model_len - params.max_tokens - 1)
    if not items:  # (before anything is built: nothing would be timed)
        raise InvalidParameterError(f"--max-model-len {settings.max_model_len} holds none of the prompt lengths "
                                    f"timed ({', '.join(map(str, LENGTHS))} tokens and {params.max_tokens} more): "
                                    f"give at least {LENGTHS[0] + params.max_tokens + 1}")
    base = LLMRecipe(settings.model, max_model_len=settings.max_model_len, prefix_caching=False)
    recipes = [DraftwiseRecipe(OFF, replace(base, prompt_kernels=False), params, reference=None),
               DraftwiseRecipe(ON, replace(base, prompt_kernels=True), params, reference=OFF),
               DraftwiseRecipe(control_name(OFF), replace(base, prompt_kernels=False), params, reference=OFF)]
    with lineup(recipes, settings.isolation) as contestants:
        sample = "\n\n".join((PACKAGE / name).read_text() for name in SAMPLE_FILES)
        quality = TeacherForced(sample, settings.eval_tokens, prompt=True)
        results = run_benchmark(contestants, items + [quality], warm_up="Hello", progress=settings.progress)
    baseline = next(r for r in results if r.name == OFF)
    lengths = sorted({item[0] for item in items}, key=lambda name: int(name.split()[0]))
    base_speeds = {length: prefill_speed([r for r in baseline.requests if r.category == length]) for length in lengths}
    figures, rows = {}, []
    for result in results:
        speeds = {length: prefill_speed([r for r in result.requests if r.category == length]) for length in lengths}
        measured, first_top1 = result.measures[0], baseline.measures[0]["top1"]
        figures[result.name] = {
            "prefill_tokens_per_second": speeds,
            "vs_baseline": {length: speeds[length] / base_speeds[length] for length in lengths},
            "equal": sum(a.token_ids == b.token_ids for a, b in zip(result.requests, baseline.requests)),
            "perplexity": measured["perplexity"],
            "top1_as_baseline": sum(a == b for a, b in zip(measured["top1"], first_top1)) / len(first_top1)}
        f = figures[result.name]
        rows.append([result.name] + [f"{speeds[length]:.0f} ({ratio(f['vs_baseline'][length])})" for length in lengths]
                    + [f"{f['equal']}/{len(items)}", f"{f['perplexity']:.3f}", f"{f['top1_as_baseline']:.1%}"])
    control = statistics.mean(figures[control_name(OFF)]["vs_baseline"].values())
    text = "\n\n".join([
        f"{settings.model}: {len(items)} prompts (HumanEval prompts joined to each length), greedy, "
        f"{params.max_tokens} tokens, prefix caching off, batch 1, interleaved (the first config rotating), "
        "each config on its own LLM" + (", in its own process." if settings.isolation == "process" else ", all in one process.")
        + f" AMX tiles on this machine: {'yes' if amx_tiles_here() else 'no (both configs compute alike)'}.",
        control_line(control, OFF, control_name(OFF), " (prefill speed, mean over the lengths)"),
        "Prefill speed: prompt tokens per second of time to first token (and against the baseline):",
        table(["config"] + lengths + ["outputs = off", f"perplexity ({quality_tokens(results)} tokens)",
                                      "top-1 = off"], rows)])
    return SuiteReport("prefill", text, {"figures": figures, "lengths": lengths})


def prompts_by_length(tokenizer, count: int, longest: int) -> list[tuple[str, str]]:
    """`count` prompts of each of LENGTHS tokens that fit `longest`: consecutive HumanEval prompts joined
    until the length is reached (category: "N tokens")."""
    pieces = [row["prompt"] for row in _jsonl(data_file("humaneval"))]
    items, at = [], 0
    for length in (n for n in LENGTHS if n <= longest):
        for _ in range(count):
            text = ""
            while len(tokenizer.encode(text)) < length:
                text += pieces[at % len(pieces)] + "\n"
                at += 1
            ids = tokenizer.encode(text)[:length]
            items.append((f"{length} tokens", tokenizer.decode(ids)))
    return items


def quality_tokens(results) -> int:
    return results[0].measures[0]["tokens"]


def prefill_speed(requests) -> float:
    """Prompt tokens per second of time to first token, over these requests."""
    return sum(r.prompt_tokens for r in requests) / sum(r.ttft for r in requests)
