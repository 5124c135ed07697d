"""A model's chat template: where it is kept, and rendering it into a prompt that never fails opaquely.

Chat templates are Jinja programs that ship with the model, so they fail in the model's own words
(`raise_exception("Conversation roles must alternate ...")`), on message shapes they did not expect
(`None + str`), or on their own syntax. Every such failure becomes a `ChatTemplateError` naming the
model, the template's message and the template line, so a server can answer 400 instead of 500.

The environment follows Hugging Face transformers' (sandboxed, `trim_blocks`, `lstrip_blocks`,
`loopcontrols`, `raise_exception`, `strftime_now`, `tojson` without ASCII escapes) so templates written
for it render the same text here.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2 import Template, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from draftwise.errors import ChatTemplateError

TEMPLATE_FILE = "chat_template.jinja"  # newer Hugging Face folders keep the template here
DEFAULT_TEMPLATE_NAME = "default"


def find_chat_template(folder: Path, tokenizer_config: dict) -> str | None:
    """The folder's chat template: `chat_template.jinja` wins over `tokenizer_config.json`'s
    `chat_template`, which is a string or a list of `{"name", "template"}` (the "default" one is used).

    GGUF files need no case of their own: the converter copies their `tokenizer.chat_template`
    into the converted folder's tokenizer_config.json."""
    template_file = folder / TEMPLATE_FILE
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        return named.get(DEFAULT_TEMPLATE_NAME)
    return template if isinstance(template, str) and template else None


class _TemplateRefusal(Exception):
    """What the template's own `raise_exception(message)` raises: its message is the whole story."""


def _raise_exception(message: str):
    raise _TemplateRefusal(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class ChatTemplate:
    """One model's template, compiled on first use (a broken template must not stop plain generation)."""

    def __init__(self, source: str, model_name: str, bos_token: str | None, eos_token: str | None) -> None:
        self.source = source
        self.model_name = model_name
        self._token_variables = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        self._compiled: Template | None = None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The prompt text for a conversation. Messages reach the template as they are given (a
        content string, or a list of content parts if the caller passes one): the template decides.
        tools: OpenAI's tool list, for templates that render it (None: the template sees none)."""
        template = self._compile()
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                   **self._token_variables)
        except _TemplateRefusal as refusal:
            raise ChatTemplateError(f"the chat template of {self.model_name!r} refused the conversation: "
                                    f"{refusal}") from None
        except Exception as error:  # anything the template trips on is the conversation's or the template's fault
            raise ChatTemplateError(f"the chat template of {self.model_name!r} failed{_template_line(error)}: "
                                    f"{type(error).__name__}: {error}") from None

    def _compile(self) -> Template:
        if self._compiled is None:
            environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                        extensions=["jinja2.ext.loopcontrols"])
            environment.globals["raise_exception"] = _raise_exception
            environment.globals["strftime_now"] = _strftime_now
            environment.filters["tojson"] = _tojson
            try:
                self._compiled = environment.from_string(self.source)
            except TemplateSyntaxError as error:
                raise ChatTemplateError(f"the chat template of {self.model_name!r} does not parse "
                                        f"(line {error.lineno}): {error.message}") from None
        return self._compiled


def _template_line(error: Exception) -> str:
    """' at line N' of the template where the error rose (Jinja maps its frames to template lines)."""
    line, trace = None, error.__traceback__
    while trace is not None:
        if trace.tb_frame.f_code.co_filename == "<template>":
            line = trace.tb_lineno
        trace = trace.tb_next
    return f" at line {line}" if line is not None else ""
