"""Checks on what a request asks for, before it reaches the engine: its prompt and its speculation."""

from __future__ import annotations

from collections.abc import Callable

from draftwise.errors import InvalidParameterError, PromptTooLongError

PER_REQUEST_SPECULATION = ("enabled", "method", "num_speculative_tokens")


def check_prompt_ids(prompt_ids: list[int], max_model_len: int) -> None:
    if not prompt_ids:
        raise InvalidParameterError("prompt is empty after tokenization")
    if len(prompt_ids) >= max_model_len:
        raise PromptTooLongError(
            f"prompt has {len(prompt_ids)} tokens; the context holds {max_model_len} "
            "(prompt and at least one generated token)")


def check_max_tokens_fit(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """OpenAI's rule: prompt + max_tokens must fit the context (not shortened silently)."""
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise PromptTooLongError(
            f"this model's context holds {max_model_len} tokens, but {num_prompt_tokens + max_tokens} were "
            f"requested ({num_prompt_tokens} in the prompt, {max_tokens} to generate)")


def request_speculation(speculative: dict | None, default_method: str | None,
                        prepare_drafter: Callable[[str], None]) -> tuple[str | None, int | None]:
    """(method, cap on k) for a request's `speculative` field; `prepare_drafter(method)` makes sure
    the engine has that drafter (or raises)."""
    if speculative is None:
        return default_method, None
    if not isinstance(speculative, dict):
        raise InvalidParameterError("speculative must be a dict")
    unknown = set(speculative) - set(PER_REQUEST_SPECULATION)
    if unknown:
        raise InvalidParameterError(f"unknown per-request speculative option(s) {sorted(unknown)}; "
                                    f"known: {list(PER_REQUEST_SPECULATION)}")
    k = speculative.get("num_speculative_tokens")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
        raise InvalidParameterError(f"num_speculative_tokens must be a non-negative integer, got {k!r}")
    if speculative.get("enabled", True) is False or k == 0:
        return None, None
    method = speculative.get("method") or default_method
    if method is None:
        raise InvalidParameterError("speculation is off for this LLM: name a method")
    prepare_drafter(method)
    return method, k
