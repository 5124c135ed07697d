"""Request and response bodies of the OpenAI API (the fields draftwise serves), and its error shape.

Validation is pydantic's: a field of the wrong type or out of range is a 400 with the field named.
Extensions, ignored by OpenAI clients: `speculative` (per-request speculation), `segment` (a traffic
label for metrics), `top_k`, `ignore_eos`, and `usage.speculation` in responses.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

SEGMENT_PATTERN = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class SpeculationRequest(BaseModel):
    """Per-request speculation: {"enabled": false}, or a method and/or k among those served."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    method: str | None = None  # a registered drafter the server was started with or builds on first use
    num_speculative_tokens: int | None = Field(default=None, ge=0, le=64)


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI fields we do not use (user, logit_bias: none) are ignored
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    n: int = Field(default=1, ge=1, le=1)  # one choice per request
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False
    logprobs: bool | int | None = None
    speculative: SpeculationRequest | None = None
    segment: str | None = None

    @field_validator("segment")
    @classmethod
    def _segment_is_a_label(cls, value: str | None) -> str | None:
        if value is not None and not SEGMENT_PATTERN.match(value):
            raise ValueError("segment must be 1-64 characters of letters, digits, '_', '.', ':' or '-'")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value):
        if value:
            raise ValueError("logprobs are not supported")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(SamplingFields):
    prompt: str | list[str]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("give one prompt per request (a string, or a list of one string)")
        return value

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text parts are served
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
