"""What the plain and quantization suites share: weight formats as configs, and their speed tables.

A format is written `FORMAT` (one of `draftwise.quant.apply.QUANTIZATIONS`; quantized layers on
draftwise's native low-bit kernels where this CPU has them, int8 activations where
that measured faster here), `FORMAT:bf16` (the native kernels, activations always bf16) or
`FORMAT:pytorch` (PyTorch's packed kernels), `FORMAT:python` (the native kernels, each decoder
layer called op by op from Python instead of as one native call) or `FORMAT:strips` (GGUF Q4_K and
Q6_K tensors in int4 and int8 strips instead of their own super-blocks). The first format is the baseline (speedups are over it; outputs are compared with its) and
its control is the first format again, built and run exactly like it. Plain decoding, greedy, batch 1,
EOS ignored (every request generates `max_tokens`); then the probes (`probes.py`), interleaved too.
"""

from __future__ import annotations

from dataclasses import asdict

from draftwise.benchmark.configs import DraftwiseRecipe, LLMRecipe, control_name
from draftwise.benchmark.probes import BuildInfo
from draftwise.benchmark.report import number, ratio, table
from draftwise.benchmark.runner import ConfigResult, lineup, run_benchmark
from draftwise.benchmark.suites import BenchSettings
from draftwise.benchmark.suites.speculative import prompts_for
from draftwise.benchmark.summary import summarize
from draftwise.errors import InvalidParameterError
from draftwise.quant.apply import QUANTIZATIONS
from draftwise.sampling.params import SamplingParams

PYTORCH_KERNELS = "pytorch"
BF16_ACTIVATIONS = "bf16"
PYTHON_LAYERS = "python"
STRIP_LAYOUTS = "strips"
KERNEL_CHOICES = ("", PYTORCH_KERNELS, BF16_ACTIVATIONS, PYTHON_LAYERS, STRIP_LAYOUTS)
MAX_TOKENS = 64


def format_recipe(settings: BenchSettings, text: str) -> LLMRecipe:
    weights, _, kernels = text.partition(":")
    if weights not in QUANTIZATIONS or kernels not in KERNEL_CHOICES:
        raise InvalidParameterError(f"a format is FORMAT, FORMAT:{BF16_ACTIVATIONS}, FORMAT:{PYTORCH_KERNELS}, "
                                    f"FORMAT:{PYTHON_LAYERS} or FORMAT:{STRIP_LAYOUTS} "
                                    f"with FORMAT one of {', '.join(QUANTIZATIONS)}, got {text!r}")
    return LLMRecipe(settings.model, quantization=weights, max_model_len=settings.max_model_len,
                     native_kernels=kernels != PYTORCH_KERNELS, int8_activations=kernels != BF16_ACTIVATIONS,
                     native_layers=kernels != PYTHON_LAYERS, superblock_kernels=kernels != STRIP_LAYOUTS)


def measure_formats(settings: BenchSettings, formats: list[str], probes: list,
                    per_category: int) -> tuple[list, list[ConfigResult], dict]:
    """Every format and the first one's control over the prompts (HumanEval by default), then the
    probes, BuildInfo first; (prompts, results, summary)."""
    formats = list(dict.fromkeys(formats))
    params = SamplingParams(temperature=0.0, max_tokens=settings.max_tokens or MAX_TOKENS, ignore_eos=True)
    prompts = prompts_for(settings, per_category, params.max_tokens, datasets=("humaneval",))
    chosen = [DraftwiseRecipe(f, format_recipe(settings, f), params, reference=formats[0]) for f in formats]
    chosen.append(DraftwiseRecipe(control_name(formats[0]), chosen[0].llm, params, reference=formats[0]))
    with lineup(chosen, settings.isolation) as contestants:
        results = run_benchmark(contestants, prompts + [BuildInfo(), *probes], progress=settings.progress)
    return prompts, results, summarize(results, baseline=formats[0])


def header(settings: BenchSettings, num_prompts: int, kernels: str = "") -> str:
    where = "each in its own process" if settings.isolation == "process" else "all in one process"
    return (f"{settings.model}: plain decoding, greedy, batch 1, {num_prompts} prompts x "
            f"{settings.max_tokens or MAX_TOKENS} tokens (EOS ignored){kernels}; formats interleaved prompt by "
            f"prompt (the first rotating), {where}.")


def speed_table(results: list[ConfigResult], summary: dict) -> str:
    rows = []
    for result in results:
        a, build = summary[result.name]["all"], result.measures[0]
        layers = "fp32 (oneDNN-packed on CPU)" if build["weights"] == "none" else build["layers"]
        rows.append([result.name, f"{build['load_seconds']:.1f}", number(a["tokens_per_s"]), ratio(a["speedup"]),
                     number(a["decode_tokens_per_s"]), number(a["prefill_tokens_per_s"], 1),
                     f"{a['equal_to_plain']}/{a['requests']}", layers])
    first = results[0].name
    return table(["format", "load s", "tokens/s (with prefill)", f"vs {first}", "decode tok/s", "prefill tok/s",
                  f"outputs = {first}", "layers"], rows)


def cost_table(results: list[ConfigResult], probe_index: int) -> str:
    """A forward pass over n new tokens (`ForwardCost`, the probe at `probe_index` among the measures),
    relative to n = 1 of the same format."""
    sizes = list(results[0].measures[probe_index]["seconds"])
    rows = []
    for result in results:
        seconds = result.measures[probe_index]["seconds"]
        rows.append([result.name, f"{seconds[1] * 1000:.1f}", *(f"{seconds[n] / seconds[1]:.2f}" for n in sizes)])
    return table(["format", "n=1 ms", *(f"n={n}" for n in sizes)], rows)


def tree_cost_table(results: list[ConfigResult], probe_index: int) -> str:
    """A pass over n tokens as a token tree relative to the same n as a chain (`ForwardCost(trees=True)`,
    each tree pass right after its chain pass)."""
    sizes = list(results[0].measures[probe_index]["seconds"])
    rows = [[result.name, *(f"{m['tree_seconds'][n] / m['seconds'][n]:.3f}" for n in sizes)]
            for result in results for m in [result.measures[probe_index]]]
    return table(["format", *(f"n={n}" for n in sizes)], rows)


def formats_data(results: list[ConfigResult], summary: dict) -> dict:
    return {"summary": summary, "measures": {r.name: r.measures for r in results},
            "requests": {r.name: [asdict(q) for q in r.requests] for r in results}}

