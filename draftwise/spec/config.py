"""How to speculate: `LLM(model=..., speculative={"method": "draft", ...})`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from draftwise.errors import InvalidParameterError
from draftwise.loading.registry import DEFAULT_DRAFT
from draftwise.quant.apply import check_quantization

METHODS = ("draft", "ngram", "layer_skip")


@dataclass(slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 5  # k, or with adaptive=True the most k may be
    adaptive: bool = True  # choose k per request and step from measured costs and acceptance (0: plain step)
    model: str | None = None  # method "draft": the draft model (default: qwen2.5-coder-0.5b)
    prompt_lookup_min: int = 1  # method "ngram": shortest suffix to look up
    prompt_lookup_max: int = 4  # method "ngram": longest suffix to look up
    num_layers: int | None = None  # method "layer_skip": target layers used to draft (default: half)
    quantization: str = "auto"  # method "draft": the draft model's weights (auto = int4_all on CPU, int4, int8, none)
    draft_confidence_threshold: float = 0.0  # "draft"/"layer_skip": stop drafting after a token drafted with
    # a probability below this (0: never)
    draft_context_window: int | None = 128  # "draft": the draft model reads only the last N tokens (None: all)
    draft_vocab_size: int | None = 32768  # "draft": LM head over the N most frequent tokens only (None: all)
    draft_probability: float = 1.0  # randomized drafting: draft with this probability per step (1: always)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidParameterError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 64:
            raise InvalidParameterError(
                f"num_speculative_tokens must be an integer from 1 to 64, got {self.num_speculative_tokens!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidParameterError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
                f"{self.prompt_lookup_max}")
        if self.num_layers is not None and self.num_layers < 1:
            raise InvalidParameterError(f"num_layers must be >= 1, got {self.num_layers}")
        check_quantization(self.quantization)
        if not isinstance(self.adaptive, bool):
            raise InvalidParameterError(f"adaptive must be true or false, got {self.adaptive!r}")
        if not 0.0 <= self.draft_confidence_threshold < 1.0:
            raise InvalidParameterError(
                f"draft_confidence_threshold must be in [0, 1), got {self.draft_confidence_threshold!r}")
        if self.draft_vocab_size is not None and (not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size < 16):
            raise InvalidParameterError(f"draft_vocab_size must be an integer >= 16, got {self.draft_vocab_size!r}")
        if self.draft_context_window is not None and (
                not isinstance(self.draft_context_window, int) or self.draft_context_window < 1):
            raise InvalidParameterError(
                f"draft_context_window must be a positive integer or None, got {self.draft_context_window!r}")
        if not 0.0 < self.draft_probability <= 1.0:
            raise InvalidParameterError(f"draft_probability must be in (0, 1], got {self.draft_probability!r}")
        if self.method == "draft" and self.model is None:
            self.model = DEFAULT_DRAFT

    @classmethod
    def from_value(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidParameterError("speculative must be a dict or a SpeculativeConfig")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidParameterError(f"unknown speculative option(s) {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise InvalidParameterError(f"speculative needs a 'method' ({', '.join(METHODS)})")
        return cls(**value)

    def to_dict(self) -> dict:
        return asdict(self)

    def drafter_key(self) -> str:
        """What determines the drafter's costs (not how it is controlled): keys the cost model cache."""
        relevant = {"draft": ("model", "quantization", "draft_vocab_size"), "ngram": ("prompt_lookup_min",
                    "prompt_lookup_max"), "layer_skip": ("num_layers",)}[self.method]
        return self.method + "(" + ", ".join(f"{name}={getattr(self, name)}" for name in relevant) + ")"
