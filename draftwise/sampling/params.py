"""Sampling parameters, with vLLM's field names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftwise.errors import InvalidParameterError


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None  # per-request seed: the same seed gives the same tokens
    max_tokens: int | None = 16  # None: up to the end of the context
    stop: list[str] | str | None = None  # strings that end generation (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise InvalidParameterError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InvalidParameterError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidParameterError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            raise InvalidParameterError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidParameterError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParameterError(f"stop must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
