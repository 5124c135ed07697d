"""Sampling parameters, with vLLM's field names and defaults, checked when made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from draftwise.errors import InvalidParameterError, check_text
from draftwise.sampling.structured_params import StructuredOutputsParams

SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what a 64-bit generator seed can hold


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None  # per-request seed: the same seed gives the same tokens, alone or batched, speculating or not
    max_tokens: int | None = 16  # None: up to the end of the context
    stop: list[str] | str | None = None  # strings that end generation (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # what the output must match (a JSON Schema, a regex, a choice, a grammar); a dict of its fields is taken too
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise InvalidParameterError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidParameterError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidParameterError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens <= 0):
            raise InvalidParameterError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise InvalidParameterError(f"seed must be an integer from -2**63 to 2**64 - 1, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParameterError(f"stop must be non-empty strings, got {self.stop!r}")
        for i, stop in enumerate(self.stop):
            check_text(stop, f"stop[{i}]")
        self.stop_token_ids = list(self.stop_token_ids)
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidParameterError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
