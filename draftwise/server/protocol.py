"""Request bodies of the OpenAI API: every field OpenAI's schemas define for completions and chat
completions, and draftwise's extensions. Nothing else is accepted (an unknown field is a 400 naming
it), types are strict (no "10" for 10, no true for 1), numbers finite. Which of these fields are
served and which are refused until implemented is `requests.py`'s job.

Extensions, ignored by OpenAI clients: `speculative` (per-request speculation), `segment` (a traffic
label for metrics), `top_k`, `ignore_eos`, and `usage.speculation` in responses; vLLM's output
constraints (`structured_outputs`, `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
and `response_format` on completions).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

SEGMENT_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"

Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Strict = ConfigDict(strict=True, extra="forbid")


class SpeculationRequest(BaseModel):
    """Per-request speculation: {"enabled": false}, or a method and/or k among those served."""

    model_config = Strict
    enabled: StrictBool = True
    method: StrictStr | None = None
    num_speculative_tokens: StrictInt | None = Field(default=None, ge=0, le=64)


class StreamOptions(BaseModel):
    model_config = Strict
    include_usage: StrictBool | None = None
    include_obfuscation: StrictBool | None = None


class SamplingFields(BaseModel):
    """Fields both endpoints share."""

    model_config = Strict
    model: StrictStr
    frequency_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None
    n: StrictInt | None = None
    presence_penalty: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    temperature: Number | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Number | None = Field(default=None, gt=0.0, le=1.0)
    user: StrictStr | None = None
    # draftwise's extensions, and vLLM's sampling fields
    top_k: StrictInt | None = Field(default=None, ge=-1)
    ignore_eos: StrictBool | None = None
    repetition_penalty: Number | None = None
    min_p: Number | None = None
    min_tokens: StrictInt | None = None
    bad_words: list[StrictStr] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    prompt_logprobs: StrictInt | None = None
    truncate_prompt_tokens: StrictInt | None = None
    speculative: SpeculationRequest | None = None
    segment: StrictStr | None = Field(default=None, pattern=SEGMENT_PATTERN)
    cache_salt: StrictStr | None = Field(default=None, min_length=1)  # vLLM's: only the same salt shares prefix blocks
    # output constraints: OpenAI's response_format (vLLM takes it on completions too), vLLM's fields
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] | None
    best_of: StrictInt | None = None
    echo: StrictBool | None = None
    logprobs: StrictInt | None = None
    max_tokens: StrictInt | None = Field(default=16, ge=1)
    suffix: StrictStr | None = None


class ChatMessage(BaseModel):
    """One message of any role; which keys a role may carry is checked in `requests.py`."""

    model_config = Strict
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: StrictStr | list[dict] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: list[dict] | None = None
    function_call: dict | None = None
    refusal: StrictStr | None = None
    audio: dict | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's chat template options (`LLM.chat`'s)
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict | None = None
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None
    audio: dict | None = None
    function_call: StrictStr | dict | None = None
    functions: list[dict] | None = None
    logprobs: StrictBool | None = None
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    metadata: dict[StrictStr, StrictStr] | None = None
    modalities: list[StrictStr] | None = None
    moderation: dict | None = None
    parallel_tool_calls: StrictBool | None = None
    prediction: dict | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_options: dict | None = None
    prompt_cache_retention: StrictStr | None = None
    reasoning_effort: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    service_tier: StrictStr | None = None
    store: StrictBool | None = None
    tool_choice: StrictStr | dict | None = None
    tools: list[dict] | None = None
    top_logprobs: StrictInt | None = None
    verbosity: StrictStr | None = None
    web_search_options: dict | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
