"""Sampling parameters, with vLLM's field names and defaults, checked when made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from draftwise.errors import InvalidParameterError, check_text
from draftwise.sampling.structured_params import StructuredOutputsParams

SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what a 64-bit generator seed can hold


def check_seed(seed, name: str = "seed") -> None:
    """None, or an integer a 64-bit generator seed can hold (SamplingParams.seed, LLM(seed=))."""
    if seed is not None and (not _is_int(seed) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise InvalidParameterError(f"{name} must be an integer from -2**63 to 2**64 - 1, got {seed!r}")
MAX_TOP_K = (1 << 63) - 1  # what the sampler's int64 top-k tensor holds (past the vocabulary: no cut)
MAX_LOGPROBS = 20  # most likely tokens asked for at each position: LLM(max_logprobs=)'s default and the server's limit
ALL_LOGPROBS = -1  # logprobs / prompt_logprobs: every token of the vocabulary (vLLM's -1)
MAX_SAMPLES = 16  # n and best_of at most
GREEDY_BELOW = 1e-5  # a temperature below this is greedy (vLLM's _SAMPLING_EPS)


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 or -1: no top-k cut; nor is one past the vocabulary (vLLM's reading)
    seed: int | None = None  # per-request seed: the same seed gives the same tokens, alone or batched, speculating or not
    max_tokens: int | None = 16  # None: up to the end of the context
    stop: list[str] | str | None = None  # strings that end generation (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (text "", no stop strings, logprobs' decoded_token None)
    # what the output must match (a JSON Schema, a regex, a choice, a grammar); a dict of its fields is taken too
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's older name for structured_outputs (its GuidedDecodingParams): moved there when made
    guided_decoding: StructuredOutputsParams | None = None
    # logits processors (`sampling.processors`), applied at every position speculation verifies
    presence_penalty: float = 0.0  # minus this for each token already in the output, in [-2, 2]
    frequency_penalty: float = 0.0  # minus this times its count in the output, in [-2, 2]
    repetition_penalty: float = 1.0  # tokens of the prompt and output: positive logits / r, negative * r
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these tokens may be generated (vLLM's field)
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability
    min_tokens: int = 0  # EOS and stop_token_ids banned, stop strings not looked for, until this many tokens
    bad_words: list[str] | None = None  # words never generated (each, and with a leading space)
    logprobs: int | None = None  # None: none; N: each generated token's logprob and the N most likely (-1: all)
    prompt_logprobs: int | None = None  # None: none; N: each prompt token's logprob and the N most likely (-1: all)
    # k: only the prompt's last k tokens are read (-1: as many as leave room for max_tokens)
    truncate_prompt_tokens: int | None = None
    n: int = 1  # samples returned per prompt
    best_of: int | None = None  # samples generated per prompt (>= n), the n most likely returned

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise InvalidParameterError("pass structured_outputs or guided_decoding (vLLM's older name), not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise InvalidParameterError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise InvalidParameterError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidParameterError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            raise InvalidParameterError(f"top_k must be -1, 0 (disabled) or a positive integer below 2**63, "
                                        f"got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens <= 0):
            raise InvalidParameterError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        check_seed(self.seed)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParameterError(f"stop must be non-empty strings, got {self.stop!r}")
        for i, stop in enumerate(self.stop):
            check_text(stop, f"stop[{i}]")
        if self.stop and self.detokenize is False:
            raise InvalidParameterError("stop strings are looked for in the text, and detokenize=False makes none: "
                                        "use stop_token_ids, or detokenize=True")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidParameterError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])  # (None: vLLM's default)
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidParameterError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise InvalidParameterError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise InvalidParameterError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidParameterError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0 or (self.max_tokens is not None
                                                                   and self.min_tokens > self.max_tokens):
            raise InvalidParameterError(f"min_tokens must be an integer from 0 to max_tokens, got {self.min_tokens!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidParameterError("logit_bias must map token ids to numbers")
            bias = {}
            for token, value in self.logit_bias.items():
                if isinstance(token, str) and token.isascii() and token.isdigit():
                    token = int(token)  # (JSON keys are strings: OpenAI's logit_bias is {"50256": -100})
                if not _is_int(token) or token < 0 or not _is_number(value) or not -100 <= value <= 100:
                    raise InvalidParameterError(f"logit_bias must map token ids to numbers in [-100, 100], "
                                                f"got {token!r}: {value!r}")
                bias[token] = float(value)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            if (not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
                    or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids)):
                raise InvalidParameterError(f"allowed_token_ids must be a non-empty list of token ids, "
                                            f"got {self.allowed_token_ids!r}")
            self.allowed_token_ids = sorted(set(self.allowed_token_ids))
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                raise InvalidParameterError("bad_words must be a list of non-empty strings")
            self.bad_words = [check_text(w, "bad_words") for w in self.bad_words] or None
        for name in ("logprobs", "prompt_logprobs"):  # (how many an LLM gives: its max_logprobs)
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < ALL_LOGPROBS):
                raise InvalidParameterError(f"{name} must be an integer >= 0, or -1 for the whole vocabulary, "
                                            f"got {value!r}")
        if self.truncate_prompt_tokens is not None and (not _is_int(self.truncate_prompt_tokens)
                                                        or not (self.truncate_prompt_tokens == -1
                                                                or self.truncate_prompt_tokens >= 1)):
            raise InvalidParameterError(f"truncate_prompt_tokens must be -1 or a positive integer, "
                                        f"got {self.truncate_prompt_tokens!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_SAMPLES:
            raise InvalidParameterError(f"n must be an integer from 1 to {MAX_SAMPLES}, got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or not self.n <= self.best_of <= MAX_SAMPLES):
            raise InvalidParameterError(f"best_of must be an integer from n to {MAX_SAMPLES}, got {self.best_of!r}")

    @property
    def greedy(self) -> bool:
        """Greedy: temperature 0, or below GREEDY_BELOW (vLLM's rule: logits / 1e-40 overflow float32)."""
        return self.temperature < GREEDY_BELOW


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
