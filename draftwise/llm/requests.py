"""Checks on what a request asks for, before it reaches the engine: its prompt and its speculation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TypedDict

from draftwise.errors import InvalidParameterError, PromptTooLongError, check_text
from draftwise.sampling.params import SamplingParams

PER_REQUEST_SPECULATION = ("enabled", "method", "num_speculative_tokens")


class TokensPrompt(TypedDict, total=False):
    """A prompt as a dict (vLLM's TokensPrompt / TextPrompt): `prompt_token_ids` (already tokenized)
    and the text it came from if known, or only the `prompt` text; and an optional `cache_salt`:
    only requests with the same salt share prefix-cache blocks (vLLM's name)."""

    prompt_token_ids: list[int]
    prompt: str
    cache_salt: str


PROMPT_KEYS = ("prompt_token_ids", "prompt", "cache_salt")


def prompt_parts(prompt: str | TokensPrompt) -> tuple[str, list[int] | None, str | None]:
    """(text, token ids or None: tokenize the text, cache_salt or None) of a prompt, checked."""
    if isinstance(prompt, dict):
        unknown = set(prompt) - set(PROMPT_KEYS)
        if unknown or not {"prompt_token_ids", "prompt"} & set(prompt):
            raise InvalidParameterError(f"a prompt dict is {{'prompt_token_ids': [...]}} or {{'prompt': text}} "
                                        f"(and optionally 'cache_salt'), got keys {sorted(prompt)}")
        salt = prompt.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise InvalidParameterError(f"cache_salt must be a non-empty string, got {salt!r}")
        if "prompt_token_ids" not in prompt:
            return text_prompt(prompt["prompt"]), None, salt
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, list) or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
            raise InvalidParameterError("prompt_token_ids must be a list of non-negative integers")
        text = prompt.get("prompt", "")
        if not isinstance(text, str):
            raise InvalidParameterError("a tokens prompt's 'prompt' must be its text")
        return check_text(text, "prompt"), ids, salt
    return text_prompt(prompt), None, None


def text_prompt(prompt) -> str:
    if not isinstance(prompt, str):
        raise InvalidParameterError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got "
                                    f"{type(prompt).__name__}")
    if not prompt:
        raise InvalidParameterError("prompt is empty")
    return check_text(prompt, "prompt")


def truncated(prompt_ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens, vLLM's left cut; -1: as many as leave the
    context room for max_tokens (for one token where max_tokens is None)."""
    keep = params.truncate_prompt_tokens
    if keep is None:
        return prompt_ids
    if keep == -1:
        keep = max(1, max_model_len - (params.max_tokens or 1))
    return prompt_ids[-keep:]


def check_against_vocabulary(prompt_ids: list[int], params: SamplingParams, vocab_size: int) -> None:
    """Token ids the model's vocabulary can hold."""
    if any(i >= vocab_size for i in prompt_ids):
        raise InvalidParameterError(f"prompt_token_ids hold an id >= the vocabulary's {vocab_size}")
    if any(i >= vocab_size for i in params.stop_token_ids):
        raise InvalidParameterError(f"stop_token_ids hold an id >= the vocabulary's {vocab_size}")
    if params.logit_bias and any(i >= vocab_size for i in params.logit_bias):
        raise InvalidParameterError(f"logit_bias holds a token id >= the vocabulary's {vocab_size}")
    if params.allowed_token_ids and any(i >= vocab_size for i in params.allowed_token_ids):
        raise InvalidParameterError(f"allowed_token_ids hold an id >= the vocabulary's {vocab_size}")


def check_logprobs_asked(params: SamplingParams, max_logprobs: int, vocab_size: int) -> None:
    """logprobs and prompt_logprobs within the LLM's max_logprobs (-1, on either side: the vocabulary)."""
    cap = vocab_size if max_logprobs == -1 else max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, name)
        if asked is not None and (vocab_size if asked == -1 else asked) > cap:
            raise InvalidParameterError(f"{name}={asked} asks for more than this LLM's max_logprobs={max_logprobs} "
                                        "(LLM(max_logprobs=N) raises it; -1 lets a request ask for every token)")


def check_allowed_tokens(params: SamplingParams, bad_words_ids: list[list[int]], end_ids: frozenset[int]) -> None:
    """allowed_token_ids that the request's own bans leave some token of: bad words of one token ban
    theirs everywhere, min_tokens bans the end tokens (`end_ids`) at the first positions."""
    if not params.allowed_token_ids:
        return
    allowed = set(params.allowed_token_ids)
    always_banned = {word[0] for word in bad_words_ids if len(word) == 1}
    if allowed <= always_banned:
        raise InvalidParameterError("allowed_token_ids: bad_words ban every one of them")
    if params.min_tokens and allowed <= always_banned | end_ids:
        raise InvalidParameterError("allowed_token_ids: every one of them ends the request or is a bad word, "
                                    "and min_tokens holds the end back: nothing could be generated")


def without_idle_top_k(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """`params` with a top_k that keeps the whole vocabulary read as no cut (0), vLLM's reading of one
    past it: the same distribution, and no step sorts the row's logits to cut nothing."""
    return replace(params, top_k=0) if params.top_k >= vocab_size else params


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
    if not isinstance(speculative.get("enabled", True), bool):
        raise InvalidParameterError(f"speculative.enabled must be true or false, got {speculative['enabled']!r}")
    if speculative.get("enabled", True) is False or k == 0:
        return None, None
    method = speculative.get("method") or default_method
    if method is None:
        raise InvalidParameterError("speculation is off for this LLM: name a method")
    prepare_drafter(method)
    return method, k


def check_messages(conversation: list, where: str) -> None:
    """A chat conversation's messages as chat templates read them: each a dict with a string `role`
    and a `content` that is text or a list of parts (None or absent only beside `tool_calls`)."""
    if not conversation:
        raise InvalidParameterError(f"{where} is empty: a conversation has at least one message")
    for i, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise InvalidParameterError(f"{where}[{i}] must be a {{'role': ..., 'content': ...}} dict, "
                                        f"got {type(message).__name__}")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise InvalidParameterError(f"{where}[{i}].role must be a non-empty string, got {message.get('role')!r}")
        content = message.get("content")
        if content is None and not message.get("tool_calls"):
            raise InvalidParameterError(f"{where}[{i}].content is missing (only a message with tool_calls "
                                        "may have none)")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidParameterError(f"{where}[{i}].content must be text or a list of parts, "
                                        f"got {type(content).__name__}")


def check_chat_options(add_generation_prompt: bool, continue_final_message: bool, tools: list[dict] | None,
                       chat_template_kwargs: dict | None) -> None:
    """chat's template options (vLLM's names) of the kinds a template reads; one the model's template
    cannot honour is refused when it renders (`ChatTemplate.render`)."""
    for name, value in (("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):
        if not isinstance(value, bool):
            raise InvalidParameterError(f"{name} must be true or false, got {value!r}")
    if add_generation_prompt and continue_final_message:  # (vLLM refuses the pair too)
        raise InvalidParameterError("continue_final_message=True goes on with the final message, "
                                    "add_generation_prompt=True opens a new turn after it: pass "
                                    "add_generation_prompt=False")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools)):
        raise InvalidParameterError(f"tools must be a list of tool dicts (OpenAI's shape), got {type(tools).__name__}")
    if chat_template_kwargs is not None and (not isinstance(chat_template_kwargs, dict)
                                             or not all(isinstance(name, str) for name in chat_template_kwargs)):
        raise InvalidParameterError("chat_template_kwargs must be a dict of the template's variables by name, "
                                    f"got {type(chat_template_kwargs).__name__}")
