"""How to speculate: `LLM(model=..., speculative={"method": "...", ...})`.

The dict is flat, as vLLM users write it: the method, the options every drafter shares (below), and
the drafter's own options (its registered dataclass: `draftwise.speculative.registry`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from draftwise.errors import InvalidParameterError
from draftwise.speculative.registry import DrafterSpec, all_specs, drafter_spec

MAX_SPECULATIVE_TOKENS = 64


def from_vllm(value: dict) -> dict:
    """vLLM's `speculative_config` dict as this package's `speculative` dict: the method by vLLM's
    name for it (a `model` without a method: the drafter registered as vLLM's default for one), and
    vLLM's `model` as the option it fills here (a draft model's `model`, a head's `head`); every other
    field keeps its name (one this package does not know is refused by name)."""
    if not isinstance(value, dict):
        raise InvalidParameterError("speculative_config must be a dict (vLLM's form)")
    config = dict(value)
    method = config.get("method")
    specs = all_specs()
    if method is None and "model" in config:
        spec = next((s for s in specs if s.vllm_model_default), None)
    else:
        spec = next((s for s in specs if method == s.name or method in s.vllm_names), None)
    if spec is None:
        return config  # (refused by name when it is read)
    config["method"] = spec.name
    target = spec.vllm_model_option
    if "model" in config and target is not None and target != "model":
        if target in config:
            raise InvalidParameterError(f"speculative_config: give the {spec.name} {target} as model or {target}, "
                                        "not both")
        config[target] = config.pop("model")
    return config


@dataclass(slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 5  # k, or with adaptive=True the most k may be
    adaptive: bool = True  # choose k per request and step from measured costs and acceptance (0: plain step)
    draft_probability: float = 1.0  # randomized drafting: draft with this probability per step (1: always)
    forced_drafts: bool = True  # structured outputs: draft the tokens a request's grammar forces
    options: Any = None  # the method's own options (its registered dataclass); None: its defaults

    def __post_init__(self) -> None:
        spec = drafter_spec(self.method) if isinstance(self.method, str) else None
        if spec is None:
            raise InvalidParameterError(f"speculative method must be a string, got {self.method!r}")
        if (not isinstance(self.num_speculative_tokens, int) or isinstance(self.num_speculative_tokens, bool)
                or not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS):
            raise InvalidParameterError(f"num_speculative_tokens must be an integer from 1 to "
                                        f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens!r}")
        for name in ("adaptive", "forced_drafts"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if (not isinstance(self.draft_probability, (int, float)) or isinstance(self.draft_probability, bool)
                or not 0.0 < self.draft_probability <= 1.0):
            raise InvalidParameterError(f"draft_probability must be in (0, 1], got {self.draft_probability!r}")
        self.options = spec.parse_options(self.options)

    @property
    def spec(self) -> DrafterSpec:
        return drafter_spec(self.method)

    @classmethod
    def from_value(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """A config from a flat dict ({"method": ..., shared options, the method's options}), or as given."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidParameterError("speculative must be a dict or a SpeculativeConfig")
        if "method" not in value:
            raise InvalidParameterError("speculative needs a 'method'")
        shared = {f.name for f in dataclasses.fields(cls)} - {"options"}
        options = {name: v for name, v in value.items() if name not in shared}
        return cls(**{name: v for name, v in value.items() if name in shared}, options=options)

    def drafter_key(self) -> str:
        """What determines the drafter's costs (not how it is controlled): keys the cost model cache."""
        return self.spec.cost_key(self.options)
