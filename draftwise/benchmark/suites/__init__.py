"""The suites of `draftwise bench --suite NAME`, one module each; every one runs through the one runner
(`draftwise.benchmark.runner`), with a plain-vs-plain control in each table and `summary.speedup`
as its speedup. A suite is a function `run(settings) -> SuiteReport`; `settings` holds what the
command line gave, each suite taking the fields it uses and its own defaults for those left None."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from draftwise.loading.registry import DEFAULT_TARGET

# name -> (module, one line for --help)
SUITES = {
    "speculative": ("speculative", "plain vs drafter configs on Spec-Bench, HumanEval or JSONL (the default)"),
    "plain": ("plain", "plain decoding speed per weight format and kernel path, and a forward's cost over n tokens"),
    "adaptive": ("adaptive", "adaptive vs fixed k per drafter, per category"),
    "concurrency": ("concurrency", "plain vs speculation under continuous batching, closed loop, per concurrency"),
    "server-load": ("server_load", "`draftwise serve` per config, N concurrent streaming openai clients"),
    "quantization": ("quantization", "weight formats (fp32, int8, int4, kernel paths): speed and quality"),
    "drafting-options": ("drafting_options", "trimmed draft head, confidence stop, randomized drafting"),
    "abuse": ("abuse", "ordinary streams beside a burst of hostile requests: what was held and lost"),
    "kernels": ("kernels", "plain, verification and speculation beside llama.cpp (--peers llama.cpp) on the same GGUF"),
    "gpu": ("gpu", "one device (--device cuda): step at 1-64 rows vs the bound, verify curve, self-drafting, costs"),
    "structured": ("structured", "constrained plain vs constrained speculative (schemas, tool calls), batch 1 and 8"),
    "grammar-engines": ("grammar_engines", "llguidance vs xgrammar: compile time, mask time, JSON Schema coverage"),
    "prefill": ("prefill", "prompts of 150-1,600 tokens with the prompt kernels (AMX) off and on: prefill speed"),
    "prefix-cache": ("prefix_cache", "a shared system prompt with prefix caching off and on: time to first token"),
    "processors": ("processors", "speculation with penalties on and off; logprobs against plain decoding's"),
    "replicas": ("replicas", "serve --replicas on Ray Serve: 2 x 1 thread vs 1 x 1 throughput; affinity vs random routing"),
}

# The settings a command line may set that each suite reads (`model` and `output`: every suite). A
# setting given to a suite that does not read it is refused by name (it would be recorded in the
# report's settings as if it had been applied). `tests/test_bench_settings_read.py` checks each set
# against what the suite's code reads.
_PROMPTS = {"datasets", "per_category", "all_turns", "seed", "max_tokens", "max_model_len"}  # `prompts_for`
READS: dict[str, set[str]] = {
    "speculative": _PROMPTS | {"configs", "options", "temperature", "isolation", "peers", "background_load"},
    "plain": _PROMPTS | {"formats", "isolation"},
    "adaptive": _PROMPTS | {"configs", "options", "temperature", "isolation", "fixed_k", "background_load"},
    "concurrency": _PROMPTS | {"configs", "options", "isolation", "levels", "requests"},
    "server-load": _PROMPTS | {"configs", "options", "levels", "requests", "time_limit"},
    "quantization": _PROMPTS | {"formats", "isolation", "eval_tokens"},
    "drafting-options": _PROMPTS | {"configs", "options", "isolation", "background_load"},
    "abuse": _PROMPTS | {"configs", "options", "levels", "requests", "time_limit", "hostile"},
    "kernels": _PROMPTS | {"configs", "options", "temperature", "isolation", "peers", "background_load"},
    "gpu": {"configs", "options", "levels", "peers", "device", "dtype", "load_format", "step_mode", "reference"},
    "structured": {"per_category", "max_tokens", "max_model_len", "configs", "options", "isolation"},
    "grammar-engines": set(),
    "prefill": {"per_category", "max_tokens", "max_model_len", "isolation", "eval_tokens"},
    "prefix-cache": {"per_category", "max_tokens", "max_model_len", "isolation"},
    "processors": _PROMPTS | {"configs", "options", "isolation"},
    "replicas": _PROMPTS | {"levels", "requests", "time_limit"},
}


@dataclass(slots=True)
class BenchSettings:
    """What `draftwise bench` was told; None: the suite's own default."""
    output: Path = Path("bench-results")
    model: str = DEFAULT_TARGET
    datasets: tuple[str, ...] | None = None  # spec-bench, humaneval or JSONL paths
    configs: tuple[str, ...] | None = None  # as `configs.parse_config` reads them (formats: `formats`)
    options: dict[str, dict] = field(default_factory=dict)  # method -> its drafter options
    per_category: int | None = None
    max_tokens: int | None = None
    temperature: float = 0.0
    seed: int = 0
    all_turns: bool = False
    peers: tuple[str, ...] = ()  # speculative: peers to run beside draftwise
    isolation: str = "process"  # `runner.ISOLATIONS`
    max_model_len: int | None = None  # None: 4096, or the model's positions if fewer (`run_suite`)
    levels: tuple[int, ...] | None = None  # concurrency: requests in flight; server-load: clients
    requests: int = 16  # concurrency, server-load: requests per level
    fixed_k: int = 3  # adaptive: the fixed k each drafter's adaptive config is compared with
    formats: tuple[str, ...] | None = None  # plain, quantization: FORMAT or FORMAT:pytorch
    eval_tokens: int = 1536  # quantization: tokens of the quality sample
    time_limit: float = 900.0  # server-load: seconds per level and config, at most
    hostile: int = 500  # abuse: hostile requests sent beside the ordinary streams
    device: str | None = None  # gpu: the device (None: cuda if present)
    dtype: str | None = None  # gpu: the dtype (None: bf16 on CUDA, fp32 on the CPU)
    load_format: str = "auto"  # gpu: "dummy" for random weights of the model's shape
    step_mode: str = "auto"  # gpu: the step under test (`LLM`'s step_mode)
    reference: Path | None = None  # gpu: a reference step script (../shared/gpu/graph_step.py)
    # server-load: the `draftwise serve` flags of a speculative dict (the CLI's, which owns the flags)
    serve_arguments: Callable[[dict | None], list[str]] | None = None
    background_load: str | None = None  # "N@F": N busy processes from fraction F of the items (`background_load`)
    progress: bool = True

    def configs_or(self, default: list[str]) -> list[str]:
        """The configs given (an empty list: plain and its control alone), else `default`."""
        return list(self.configs) if self.configs is not None else default


def default_context(model: str) -> int:
    """The LLM's default max_model_len for `model` (4096, or the model's positions if fewer)."""
    from draftwise.llm.llm import DEFAULT_MAX_MODEL_LEN
    from draftwise.loading.hf_folder import read_config
    from draftwise.loading.resolve import resolve_model

    return min(DEFAULT_MAX_MODEL_LEN, read_config(resolve_model(model, progress=False)).max_position_embeddings)


def run_suite(name: str, settings: BenchSettings):
    """Run suite `name`; its `SuiteReport`, whose data records the settings too."""
    module = importlib.import_module(f"draftwise.benchmark.suites.{SUITES[name][0]}")
    if settings.max_model_len is None:
        settings = replace(settings, max_model_len=default_context(settings.model))
    report = module.run(settings)
    report.data["settings"] = {f.name: getattr(settings, f.name) for f in fields(settings)
                               if f.name != "serve_arguments"}
    return report
