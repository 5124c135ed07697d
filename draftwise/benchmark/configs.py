"""draftwise configs: the syntax users write, how a config's LLM is built, and the contestant that runs
prompts and probes on it.

A config is written `plain`, `METHOD` (adaptive, k <= 8), `METHOD:k=K` (fixed k) or `METHOD:k<=K`
(adaptive, k <= K), then any `:OPTION=VALUE` of the drafter's (`draft:draft_branches=2`: two
configs of one drafter in one run); METHOD is a registered drafter (`draftwise.speculative.registry`), and the
drafters run by default are those registered with `benchmark_by_default`. Each config gets its own
LLM (its own drafter, cost model and controller memory) and a warm-up request (4 tokens: builds the
drafter's state); then every prompt runs once, batch 1, with the run's sampling parameters and seed.
`recipes` puts plain decoding first (every output is compared with its outputs) and the control
last: plain decoding again, built and run exactly like plain (`runner` says why it is there).
"""

from __future__ import annotations

import os
import re
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

from draftwise.benchmark.runner import RequestResult
from draftwise.errors import InvalidParameterError
from draftwise.sampling.params import SamplingParams
from draftwise.speculative.registry import all_specs, names, option_value

PLAIN = "plain"
CONFIG_PATTERN = re.compile(r"^(\w+)(?::k(=|<=)(\d+))?((?::\w+=[^:=]+)*)$")
DEFAULT_ADAPTIVE_K = 8
NATIVE_KERNELS_ENV = "DRAFTWISE_NATIVE_KERNELS"


def control_name(baseline: str) -> str:
    """The control of a baseline config: the same config again, run exactly like it."""
    return f"{baseline} (control)"


CONTROL = control_name(PLAIN)


def default_configs() -> list[str]:
    """The drafters benchmarked unless told otherwise, adaptive."""
    return [spec.name for spec in all_specs() if spec.benchmark_by_default]


def config_method(text: str) -> str:
    """The drafter a config names ('ngram:k=2' -> 'ngram'); unknown names and bad forms raise."""
    match = CONFIG_PATTERN.match(text)
    if not match or match.group(1) not in names():
        raise InvalidParameterError(f"config must be plain, METHOD, METHOD:k=K or METHOD:k<=K, then any "
                                    f":OPTION=VALUE (METHOD one of {', '.join(names())}), got {text!r}")
    return match.group(1)


def parse_config(text: str, options: dict[str, dict] | None = None) -> dict | None:
    """'plain' -> None; 'ngram:k=2' -> a speculative dict for `LLM(speculative=...)`, with the
    method's `options[method]` added."""
    if text == PLAIN:
        return None
    method = config_method(text)
    _, relation, k, extra = CONFIG_PATTERN.match(text).groups()
    spec: dict = {"method": method, "num_speculative_tokens": int(k) if k else DEFAULT_ADAPTIVE_K,
                  "adaptive": relation != "=", **(options or {}).get(method, {})}
    for pair in filter(None, extra.split(":")):
        name, value = pair.split("=", 1)
        spec[name] = option_value(value)
    if spec["num_speculative_tokens"] < 1:
        raise InvalidParameterError(f"k must be at least 1 in {text!r}")
    return spec


def is_adaptive(text: str) -> bool:
    """Whether a drafter config lets the controller choose k ('ngram', 'ngram:k<=4'; not 'ngram:k=2')."""
    config_method(text)
    return CONFIG_PATTERN.match(text).group(2) != "="


@dataclass(frozen=True, slots=True)
class LLMRecipe:
    """How a config's LLM is built (it pickles: a worker process builds it from this)."""
    model: str
    speculative: dict | None = None
    quantization: str = "auto"
    max_num_seqs: int = 1
    max_model_len: int | None = None  # (None: the LLM's default)
    native_kernels: bool = True  # False: quantized layers on PyTorch's packed kernels
    int8_activations: bool = True  # False: quantized layers keep bf16 activations (else as measured here)
    native_layers: bool = True  # False: decoder layers op by op from Python (the same kernels)
    superblock_kernels: bool = True  # False: GGUF Q4_K/Q6_K layers in int4/int8 strips, not their own super-blocks
    prefix_caching: bool = True  # LLM(enable_prefix_caching=...)
    prompt_kernels: bool | None = None  # LLM(prompt_kernels=...)

    def build(self):
        from draftwise.llm import LLM
        from draftwise.model import native_decoder
        from draftwise.quant import activation_choice, native, superblock_strips

        overrides = {}
        if not self.native_kernels:
            overrides[NATIVE_KERNELS_ENV] = "0"  # read when the layers are built
        if not self.int8_activations:
            overrides[activation_choice.ACTIVATIONS_ENV] = "0"
        if not self.native_layers:
            overrides[native_decoder.NATIVE_LAYERS_ENV] = "0"  # read when each model is built
        if not self.superblock_kernels:
            overrides[superblock_strips.SUPERBLOCKS_ENV] = "0"  # read when the layers are built
        with _environment(overrides):
            if overrides:
                native.kernels.cache_clear()
            try:
                return LLM(self.model, speculative=self.speculative, quantization=self.quantization,
                           max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len, progress=False,
                           enable_prefix_caching=self.prefix_caching, prompt_kernels=self.prompt_kernels)
            finally:
                if overrides:  # in-process builds after this one get the path they ask for
                    native.kernels.cache_clear()


@contextmanager
def _environment(overrides: dict[str, str]):
    """Environment variables set for the block, restored after it."""
    before = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclass(slots=True)
class DraftwiseConfig:
    """One draftwise config on its own LLM: runs prompts (batch 1) and probes."""
    name: str
    llm: object  # draftwise.LLM
    params: SamplingParams
    reference: str = PLAIN
    load_seconds: float = 0.0  # building the LLM (and its drafter)

    def warm_up(self, prompt: str) -> None:
        self.llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4))
        self.llm.forget_drafter_history()  # (the measured requests are not drafted from the warm-up's text)
        self.llm.reset_prefix_cache()  # (nor prefilled from its blocks: the warm-up prompt is the first item's)

    def run(self, item):
        """item: a probe, (category, prompt), or (category, prompt, SamplingParams fields of its own)."""
        if not isinstance(item, tuple):
            return item.measure(self)
        category, prompt, *extra = item
        params = replace(self.params, **extra[0]) if extra else self.params
        output = self.llm.generate(prompt, params, segment=category)[0]
        metrics, spec = output.metrics, output.metrics.spec
        steps = (spec.num_drafts + spec.num_plain_steps) if spec else 0
        steps = steps or max(0, len(output.token_ids) - 1)  # plain decoding: one step per token after the first
        return RequestResult(category, len(output.token_ids), metrics.seconds, metrics.time_to_first_token or 0.0,
                             list(output.token_ids), steps, asdict(spec) if spec else None,
                             metrics.num_prompt_tokens)


@dataclass(frozen=True, slots=True)
class DraftwiseRecipe:
    name: str
    llm: LLMRecipe
    params: SamplingParams
    reference: str = PLAIN

    def build(self) -> list[DraftwiseConfig]:
        started = time.perf_counter()
        llm = self.llm.build()
        return [DraftwiseConfig(self.name, llm, self.params, self.reference, time.perf_counter() - started)]


def recipes(base: LLMRecipe, named: dict[str, dict | None], params: SamplingParams) -> list[DraftwiseRecipe]:
    """Plain decoding (`base`), each named config (its speculative dict on `base`), then the control."""
    chosen = [DraftwiseRecipe(PLAIN, base, params)]
    chosen += [DraftwiseRecipe(name, replace(base, speculative=spec), params) for name, spec in named.items()
               if name not in (PLAIN, CONTROL)]
    return chosen + [DraftwiseRecipe(CONTROL, base, params)]


def config_recipes(base: LLMRecipe, configs: list[str], params: SamplingParams,
                   options: dict[str, dict] | None = None) -> list[DraftwiseRecipe]:
    """`recipes` for configs as users write them; `options`: method -> its drafter options."""
    return recipes(base, {name: parse_config(name, options) for name in dict.fromkeys(configs)}, params)
