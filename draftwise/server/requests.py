"""From an OpenAI request body to what the engine runs: the prompt, `SamplingParams` and options.

Every field of the OpenAI schemas is either served or refused here with a 400 that names it; a
field is accepted unserved only where its value is the neutral one (`n: 1`, `presence_penalty: 0`,
`functions: []` ...) or where it changes no output (`user`,
`metadata`, `safety_identifier`, `prompt_cache_key`: labels and hints). Limits (stop strings, the
prompt's size before it is tokenized) come from `ServerLimits`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from draftwise.errors import InvalidParameterError
from draftwise.llm.requests import check_chat_options
from draftwise.sampling.params import MAX_LOGPROBS, SamplingParams
from draftwise.sampling.structured_params import StructuredOutputsParams
from draftwise.server import DEFAULT_MAX_REQUEST_BYTES
from draftwise.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from draftwise.server.structured import StructuredRequestError, requested_structure
from draftwise.server.tools import ToolRequestError, assistant_calls, plan_tools

LATER = {         "functions": "the deprecated functions / function_call fields are not served; use tools and tool_choice",
         "openai": "a feature of OpenAI's hosted models that this server does not have"}

# field -> (is the value neutral?, why anything else is refused)
_COMMON: dict[str, tuple[Callable, str]] = {
    "spaces_between_special_tokens": (lambda v: v in (None, False), "special tokens are decoded without spaces "
                                                                    "between them (send false or leave it out)"),
}
_COMPLETIONS: dict[str, tuple[Callable, str]] = {
}
_CHAT: dict[str, tuple[Callable, str]] = {
    "audio": (lambda v: v is None, LATER["openai"]),
    "function_call": (lambda v: v in (None, "none"), LATER["functions"]),
    "functions": (lambda v: not v, LATER["functions"]),
    "modalities": (lambda v: v in (None, ["text"]), "only text output is served"),
    "moderation": (lambda v: v is None, LATER["openai"]),
    "prediction": (lambda v: v is None, "predicted outputs are not implemented yet"),
    "prompt_cache_options": (lambda v: v is None, LATER["openai"]),
    "prompt_cache_retention": (lambda v: v is None, LATER["openai"]),
    "reasoning_effort": (lambda v: v is None, "this model does not reason in a separate channel"),
    "service_tier": (lambda v: v in (None, "auto", "default"), LATER["openai"]),
    "store": (lambda v: v in (None, False), "completions are not stored"),
    "verbosity": (lambda v: v is None, LATER["openai"]),
    "web_search_options": (lambda v: v is None, LATER["openai"]),
}


class RequestError(Exception):
    """A request the server refuses: an HTTP status and an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}




MAX_BATCH_PROMPTS = 128  # prompts a completions request may batch


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a larger body gets 413 before it is read
    max_stop_sequences: int = 16
    max_stop_chars: int = 256


@dataclass(frozen=True, slots=True)
class Served:
    """The speculation this server offers: the drafters a request may name, and the default."""

    methods: frozenset[str]
    default: str | None


@dataclass(slots=True)
class EngineRequest:
    """What one request asks the engine for (the prompt not yet tokenized)."""

    params: SamplingParams
    options: dict  # LLM.add_request's keyword options
    text: str | None = None  # a completion's prompt text
    token_ids: list[int] | None = None  # a completion's prompt as token ids
    messages: list[dict] | None = None  # a chat: [{"role", "content"}] for the chat template
    tools: list[dict] | None = None  # a chat's tools, for the chat template
    calls_tools: bool = False  # the answer may call tools: read them out of its text
    constraint_param: str | None = None  # the field that set a constraint (named when it does not compile)
    num_prompt_chars: int = 0  # the prompt's characters before tokenizing (the length check)
    chat: bool = False
    method: str | None = None  # the drafter it runs with (metrics), None: plain
    echo: bool = False  # a completion's text starts with its prompt
    fim_suffix: str | None = None  # a completion's fill-in-the-middle suffix (the prompt is the prefix)
    chat_options: dict = field(default_factory=dict)  # a chat's template options (`Tokenizer.encode_chat`'s)

    @property
    def prompt_param(self) -> str:
        """The field that holds the prompt (named when it is too long)."""
        return "messages" if self.chat else "prompt"


def completion_requests(body: CompletionRequest, limits: ServerLimits, served: Served) -> list[EngineRequest]:
    """One request for the engine per prompt of the body: `prompt` may be a batch (a list of strings,
    or of token-id lists), each prompt answered as a request of its own with the body's options
    (OpenAI's and vLLM's choices: prompt i's samples are choices i n ... i n + n - 1). The options
    are read and checked once, then given to every prompt."""
    prompts = _prompts(body.prompt)
    options = _completion_options(body, limits, served)
    return [_with_prompt(options, body, prompt) for prompt in prompts]


def completion_request(body: CompletionRequest, limits: ServerLimits, served: Served) -> EngineRequest:
    """The request of a body of one prompt."""
    requests = completion_requests(body, limits, served)
    if len(requests) != 1:
        raise RequestError(400, "a batch of prompts: one request each (`completion_requests`)", "prompt")
    return requests[0]


def _prompts(prompt) -> list[str | list[int]]:
    """The prompts of a completions body: one string, one token-id list, or a batch of either."""
    if prompt is None:
        raise RequestError(400, "prompt is required", "prompt")
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        batch = [prompt]
    else:
        batch = list(prompt)
    if len(batch) > MAX_BATCH_PROMPTS:
        raise RequestError(400, f"prompt: a batch of {len(batch)} prompts; at most {MAX_BATCH_PROMPTS} a request",
                           "prompt")
    for index, one in enumerate(batch):
        if isinstance(one, list) and not one:
            raise RequestError(400, "prompt is empty" if len(batch) == 1 else f"prompt[{index}] is empty", "prompt")
    return batch


def _completion_options(body: CompletionRequest, limits: ServerLimits, served: Served) -> EngineRequest:
    """What every prompt of a completions body is asked with (the request without its prompt)."""
    _refuse_unserved(body, {**_COMMON, **_COMPLETIONS})
    structure, field = _structure(body)
    request = EngineRequest(_sampling_params(body, body.max_tokens, limits, structure), _options(body, served),
                            constraint_param=field)
    if body.echo:
        if body.logprobs is not None:  # (the prompt's tokens are listed too: their logprobs are needed)
            request.params = replace(request.params, prompt_logprobs=max(request.params.prompt_logprobs or 0,
                                                                         body.logprobs))
        if body.suffix is not None:
            raise RequestError(400, "echo and suffix together are not supported", "echo", "unsupported_parameter")
        request.echo = True
    request.method = _method(request.options, served)
    return request


def _with_prompt(options: EngineRequest, body: CompletionRequest, prompt: str | list[int]) -> EngineRequest:
    """`options` asked of one prompt (its own copy: the engine keeps a request's options apart)."""
    request = replace(options, options=copy.deepcopy(options.options))
    if isinstance(prompt, list):
        request.token_ids = prompt
    else:
        request.text = prompt
        request.num_prompt_chars = len(prompt)
    if body.suffix is not None:
        if request.text is None:
            raise RequestError(400, "suffix needs a text prompt (the part before the gap)", "suffix")
        request.fim_suffix = body.suffix
        request.num_prompt_chars += len(body.suffix)
    return request


def chat_request(body: ChatCompletionRequest, limits: ServerLimits, served: Served,
                 chat_template: str | None = None, tool_tags_are_tokens: bool = True) -> EngineRequest:
    """chat_template: the model's (whether it knows the tool-call format); tool_tags_are_tokens:
    `<tool_call>` is a special token of its vocabulary."""
    _refuse_unserved(body, {**_COMMON, **_CHAT})
    chat_options = _chat_options(body)
    structure, field = _structure(body)
    try:
        tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, chat_template)
    except ToolRequestError as error:
        raise RequestError(400, str(error), error.param) from None
    if tools is not None:
        if structure is not None:
            raise RequestError(400, f"{field} and tools cannot be combined (send tool_choice none to constrain "
                               "a plain answer)", field)
        structure, field = tools.constraint(tool_tags_are_tokens), "tools"
    params = _sampling_params(body, body.token_limit, limits, structure, keep_special=tools is not None)
    request = EngineRequest(params, _options(body, served), chat=True, constraint_param=field)
    request.messages = [_message(m, i) for i, m in enumerate(body.messages)]
    request.num_prompt_chars = sum(len(m["content"] or "") for m in request.messages)
    request.chat_options = chat_options
    if tools is not None:
        request.tools, request.calls_tools = tools.tools, True
        request.num_prompt_chars += len(json.dumps(tools.tools))
    request.method = _method(request.options, served)
    return request


def _chat_options(body: ChatCompletionRequest) -> dict:
    """The body's chat template options (vLLM's fields), checked as `LLM.chat` checks them. A template
    of the client's own is refused: it would run on the server, and a sandboxed Jinja template can
    still spend the server's memory and time (`'x' * 10**9`); vLLM too takes one only from a server
    started to trust them."""
    if body.chat_template is not None:
        raise RequestError(400, "chat_template is not taken from requests (a client's template would run on the "
                           "server); the model's template renders every chat, with chat_template_kwargs, "
                           "add_generation_prompt and continue_final_message", "chat_template",
                           "unsupported_parameter")
    options = {"chat_template_kwargs": body.chat_template_kwargs,
               "add_generation_prompt": True if body.add_generation_prompt is None else body.add_generation_prompt,
               "continue_final_message": bool(body.continue_final_message)}
    try:
        check_chat_options(options["add_generation_prompt"], options["continue_final_message"], None,
                           body.chat_template_kwargs)
    except InvalidParameterError as error:
        raise RequestError(400, str(error), _param_named(str(error))) from None
    return options


def _structure(body: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    try:
        return requested_structure(body)
    except StructuredRequestError as error:
        raise RequestError(400, str(error), error.param) from None


def _refuse_unserved(body: SamplingFields, table: dict[str, tuple[Callable, str]]) -> None:
    for name, (neutral, why) in table.items():
        if not neutral(getattr(body, name)):
            raise RequestError(400, f"{name} is not supported: {why}", name, "unsupported_parameter")
    if body.stream_options is not None and not body.stream:
        raise RequestError(400, "stream_options needs stream: true", "stream_options")
    if body.stream_options is not None and body.stream_options.include_obfuscation:
        raise RequestError(400, "stream_options.include_obfuscation is not supported", "stream_options",
                           "unsupported_parameter")


def _message(message: ChatMessage, index: int) -> dict:
    """A message as the chat template reads it: role and content, an assistant's tool calls, a tool
    result's call id."""
    where = f"messages[{index}]"
    _refuse_unsupported(message, where)
    rendered = {"role": message.role}
    if message.role == "assistant" and message.tool_calls:
        try:
            rendered["tool_calls"] = assistant_calls(message.tool_calls, where)
        except ToolRequestError as error:
            raise RequestError(400, str(error), error.param) from None
        if message.content is None:
            rendered["content"] = None
            return rendered
    if message.role == "tool":
        if not isinstance(message.tool_call_id, str):
            raise RequestError(400, f"{where}.tool_call_id is required on a tool message", f"{where}.tool_call_id")
        rendered["tool_call_id"] = message.tool_call_id
    rendered["content"] = _message_text(message, index)
    return rendered


def _refuse_unsupported(message: ChatMessage, where: str) -> None:
    """A message's fields the chat template has no place for, refused by name (an assistant's tool
    calls without content too)."""
    if message.role == "function":
        raise RequestError(400, f"{where}: function messages are not supported: {LATER['functions']}",
                           f"{where}.role", "unsupported_parameter")
    if message.tool_calls and message.role != "assistant":
        raise RequestError(400, f"{where}.tool_calls is only for assistant messages", f"{where}.tool_calls",
                           "unsupported_parameter")
    if message.function_call:
        raise RequestError(400, f"{where}.function_call is not supported: {LATER['functions']}",
                           f"{where}.function_call", "unsupported_parameter")
    if message.tool_call_id is not None and message.role != "tool":
        raise RequestError(400, f"{where}.tool_call_id is only for tool messages", f"{where}.tool_call_id",
                           "unsupported_parameter")
    for key in ("refusal", "audio"):
        if getattr(message, key) is not None:
            raise RequestError(400, f"{where}.{key} is not supported on a {message.role} message", f"{where}.{key}",
                               "unsupported_parameter")
    if message.name is not None:
        raise RequestError(400, f"{where}.name is not supported: the chat template has no place for "
                           "participant names", f"{where}.name", "unsupported_parameter")


def _message_text(message: ChatMessage, index: int) -> str:
    where = f"messages[{index}]"
    if message.content is None:
        raise RequestError(400, f"{where}.content is required", f"{where}.content")
    if isinstance(message.content, str):
        return message.content
    texts = []
    for j, part in enumerate(message.content):
        kind = part.get("type")
        if kind != "text" or set(part) != {"type", "text"} or not isinstance(part["text"], str):
            shown = kind if isinstance(kind, str) else "without a type"
            raise RequestError(400, f"{where}.content[{j}]: content parts of type {shown!r} are not supported "
                               "(text parts {\"type\": \"text\", \"text\": ...} only)", f"{where}.content[{j}]",
                               "unsupported_parameter")
        texts.append(part["text"])
    return "\n".join(texts)


def _sampling_params(body: SamplingFields, max_tokens: int | None, limits: ServerLimits,
                     structure: StructuredOutputsParams | None, keep_special: bool = False) -> SamplingParams:
    """keep_special: the answer's text keeps special tokens (a tool call's `<tool_call>` tags)."""
    if body.prompt_logprobs is not None and body.stream:  # (vLLM's rule: they come with the whole answer)
        raise RequestError(400, "prompt_logprobs cannot stream: ask without stream", "prompt_logprobs",
                           "unsupported_parameter")
    for name in ("logprobs", "prompt_logprobs"):  # (the server's cap: the LLM's may be raised for the library)
        value = getattr(body, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= MAX_LOGPROBS:
            raise RequestError(400, f"{name} must be an integer from 0 to {MAX_LOGPROBS}, got {value}", name)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > limits.max_stop_sequences:
        raise RequestError(400, f"stop holds {len(stop)} sequences; at most {limits.max_stop_sequences}", "stop")
    if any(len(s) > limits.max_stop_chars for s in stop):
        raise RequestError(400, f"a stop sequence is longer than {limits.max_stop_chars} characters", "stop")
    optional = {name: getattr(body, name) for name in (
        "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens",
        "bad_words", "allowed_token_ids", "stop_token_ids", "include_stop_str_in_output", "prompt_logprobs",
        "truncate_prompt_tokens")
        if getattr(body, name) is not None}
    skip_special = body.skip_special_tokens if body.skip_special_tokens is not None else not keep_special
    try:
        return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, seed=body.seed,
                              max_tokens=max_tokens, stop=stop, ignore_eos=bool(body.ignore_eos),
                              structured_outputs=structure, skip_special_tokens=skip_special,
                              logprobs=_logprobs(body), n=1 if body.n is None else body.n,
                              best_of=getattr(body, "best_of", None), **optional)
    except InvalidParameterError as error:
        raise RequestError(400, str(error), _param_named(str(error))) from None


def _logprobs(body: SamplingFields) -> int | None:
    """How many alternatives each generated token's logprob comes with (None: no logprobs):
    completions' `logprobs: N`, chat's `logprobs: true` with `top_logprobs: N`."""
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise RequestError(400, f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}, got "
                               f"{body.top_logprobs}", "top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def _options(body: SamplingFields, served: Served) -> dict:
    options = {"max_tokens_must_fit": True, "segment": body.segment}
    spec = body.speculative
    if spec is not None:
        if spec.method is not None and spec.method not in served.methods:  # (even where it says off)
            raise RequestError(400, f"speculative method {spec.method!r} is not served here; served: "
                               f"{sorted(served.methods) or 'none'}", "speculative.method")
        if not spec.enabled or spec.num_speculative_tokens == 0:
            options["speculative"] = {"enabled": False}
        else:
            if spec.method is None and served.default is None:
                raise RequestError(400, "this server decodes without speculation unless a request names "
                                   f"speculative.method (served: {sorted(served.methods) or 'none'})",
                                   "speculative.method")
            options["speculative"] = spec.model_dump(exclude_none=True)
    return options


def _method(options: dict, served: Served) -> str | None:
    """The drafter a request runs with (for metrics labels; None: plain decoding)."""
    speculative = options.get("speculative")
    if speculative is None:
        return served.default
    if speculative.get("enabled", True) is False:
        return None
    return speculative.get("method") or served.default


def _param_named(message: str) -> str | None:
    first = message.split(" ", 1)[0]
    return first if first.isidentifier() else None
