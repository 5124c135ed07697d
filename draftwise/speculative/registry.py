"""The drafter registry: every way of drafting, by name, with its options, its builder and its profiler.

A drafter is one module in `draftwise/speculative/drafters/` that calls `register(DrafterSpec(...))`
once; the modules there are found and imported on first use. Everything that offers drafters to
users reads this registry: `SpeculativeConfig` validates options with it, the LLM builds drafters
with it, and the CLI (its flags), the server (its per-request `speculative` field), the planner and
the benchmark list what it holds. No other module spells a drafter's name.

Options are a dataclass per drafter, validated in `__post_init__`. Each field may carry metadata
(`option(...)`): a help line, a command-line flag (default `--field-name`), whether 0 on the
command line means None, and whether the value changes what drafting costs (those fields key the
cached cost model).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftwise.errors import InvalidParameterError
from draftwise.runner.model_runner import ModelRunner
from draftwise.speculative.proposer import Proposer
from draftwise.text.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Target:
    """What a drafter is built from: the target model, its tokenizer and the engine's shape."""

    name: str  # the target as the user named it
    folder: Path
    tokenizer: Tokenizer
    runner: ModelRunner
    max_num_seqs: int
    max_model_len: int
    progress: bool = True  # show progress bars while fetching or converting a model
    load_format: str = "auto"  # "dummy": a drafter with a model of its own gets random weights too


@dataclass(frozen=True, slots=True)
class DrafterSpec:
    name: str  # what users write: {"method": name}
    summary: str  # one line: what it drafts with
    options: type  # a dataclass of the drafter's options (every field with a default)
    build: Callable[[Target, Any], Proposer]  # (target, options) -> a proposer serving every request
    # Checks that can fail before the target's weights load (a draft model that does not exist, or
    # speaks another vocabulary): (options, target tokenizer, target name, progress) -> None.
    check: Callable[[Any, Tokenizer, str, bool], None] | None = None
    per_request: bool = True  # may be built on first use for a request (False: it loads a model of its own)
    benchmark_by_default: bool = True  # run by `draftwise bench` / `draftwise plan` unless told otherwise
    # How the cost model profiles it: (target runner, proposer, tokenizer, max k) -> CostModel. None:
    # `control.profile.measure`, which times the target over n tokens and `propose` over k tokens.
    profile: Callable | None = None
    # Its options' `model` names a model speaking the target's vocabulary, which may be the target
    # itself: the target then drafts for itself, the direct test of batch invariance (`bench --suite gpu`).
    drafts_with_model: bool = False
    # A drafter with a head trained by `draftwise train-head --kind NAME`: (target model, tokenizer,
    # target name, examples, `heads.training.TrainSettings`, folder, notes for its config, progress)
    # -> `TrainResult`, the head written to the folder. None: nothing to train.
    train: Callable | None = None
    # The target layers (0-based) whose residual streams, after them, its training reads beside the
    # last normed one: (target model config) -> layers. Captured while the target answers (`Example.aux`).
    train_layers: Callable[[Any], tuple[int, ...]] | None = None
    # The `TrainSettings` fields its training reads beyond the shared ones (epochs, learning rate,
    # batch size, held-out share, kept tokens, heads): `train-head` refuses the others when given.
    train_reads: frozenset[str] = frozenset()
    # vLLM's `speculative_config` (`config.from_vllm`): the method names vLLM gives this drafter
    # besides `name`; the option here that vLLM's `model` field fills (None: vLLM's `model` is not
    # this drafter's); whether a `model` given without a method means this drafter.
    vllm_names: tuple[str, ...] = ()
    vllm_model_option: str | None = None
    vllm_model_default: bool = False

    def parse_options(self, values: dict | Any | None) -> Any:
        """The drafter's options from a dict (unknown names refused), an instance, or None (defaults)."""
        if values is None:
            return self.options()
        if isinstance(values, self.options):
            return values
        if not isinstance(values, dict):
            raise InvalidParameterError(f"options of drafter {self.name!r} must be a dict")
        known = [f.name for f in dataclasses.fields(self.options)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise InvalidParameterError(
                f"unknown option(s) {unknown} for speculative method {self.name!r}; it takes "
                f"{known or 'no options'} besides num_speculative_tokens, adaptive and draft_probability")
        zero_means_none = {f.name for f in dataclasses.fields(self.options) if f.metadata.get("zero_is_none")}
        values = {name: None if name in zero_means_none and value == 0 and not isinstance(value, bool) else value
                  for name, value in values.items()}  # "0: all", as on the command line
        return self.options(**values)

    def cost_key(self, options: Any) -> str:
        """What determines this drafter's costs (not how it is controlled): keys the cost model's cache."""
        relevant = [f.name for f in dataclasses.fields(self.options) if f.metadata.get("cost")]
        return self.name + "(" + ", ".join(f"{name}={getattr(options, name)}" for name in relevant) + ")"


def option(default: Any, help: str, *, flag: str | None = None, zero_is_none: bool = False,
           cost: bool = False) -> Any:
    """A field of a drafter's options dataclass, described for the command line and the cost model."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "zero_is_none": zero_is_none,
                                                        "cost": cost})


def option_value(text: str) -> int | float | bool | str:
    """An option's value written as text (a command line's "name=value"): a number, true/false, or text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


_REGISTRY: dict[str, DrafterSpec] = {}
_discovered = False


def register(spec: DrafterSpec) -> DrafterSpec:
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"a drafter named {spec.name!r} is already registered")
    if not dataclasses.is_dataclass(spec.options):
        raise TypeError(f"drafter {spec.name!r}: options must be a dataclass")
    _REGISTRY[spec.name] = spec
    return spec


def _discover() -> None:
    """Import every module of `draftwise.speculative.drafters` (each registers itself)."""
    global _discovered
    if _discovered:
        return
    from draftwise.speculative import drafters

    for module in pkgutil.iter_modules(drafters.__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{drafters.__name__}.{module.name}")
    _discovered = True


def names() -> list[str]:
    """Every registered drafter, in registration order."""
    _discover()
    return list(_REGISTRY)


def drafter_spec(name: str) -> DrafterSpec:
    _discover()
    if name not in _REGISTRY:
        raise InvalidParameterError(f"speculative method must be one of {', '.join(_REGISTRY)}, got {name!r}")
    return _REGISTRY[name]


def all_specs() -> list[DrafterSpec]:
    _discover()
    return list(_REGISTRY.values())
