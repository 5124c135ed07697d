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
from functools import cached_property
from pathlib import Path

from jinja2 import Template, TemplateSyntaxError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from draftwise.errors import ChatTemplateError, InvalidParameterError

TEMPLATE_FILE = "chat_template.jinja"  # newer Hugging Face folders keep the template here
DEFAULT_TEMPLATE_NAME = "default"
FINAL_MARKER = "\x00draftwise:final-message\x00"  # (stands in for a continued message's text: `_cut_after_final_message`)
CHAT_ARGUMENTS = ("messages", "tools", "add_generation_prompt")  # what every rendering passes the template


def read_chat_template(value: str) -> str:
    """A `--chat-template` value as vLLM reads it: a file's path (its text), or the template itself on
    one line (escapes such as \\n read as the characters they stand for). A value with no Jinja or
    line-break characters that names no readable file is refused as the path it looks like."""
    try:
        source = Path(value).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InvalidParameterError(f"--chat-template {value}: not a UTF-8 text file") from None
    except (OSError, ValueError) as error:  # (ValueError: a NUL in the value)
        if not any(c in value for c in "{}\n"):
            reason = getattr(error, "strerror", None) or str(error)
            raise InvalidParameterError(f"--chat-template {value!r} looks like a file's path, but it cannot be "
                                        f"read ({reason})") from None
        try:  # (characters beyond Latin-1 pass through as escapes of their own)
            source = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
        except UnicodeDecodeError as escape:
            raise InvalidParameterError(f"--chat-template: a bad escape in the template given ({escape.reason})") from None
    if not source.strip():
        raise InvalidParameterError(f"--chat-template {value!r}: the template is empty")
    return source


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

    def __init__(self, source: str, model_name: str, bos_token: str | None, eos_token: str | None,
                 described: str | None = None) -> None:
        """described: how errors name it (default: the chat template of the model)."""
        self.source = source
        self.model_name = model_name
        self.described = described or f"the chat template of {model_name!r}"
        self._token_variables = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        self._compiled: Template | None = None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None, *,
               continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> str:
        """The prompt text for a conversation. Messages reach the template as they are given (a
        content string, or a list of content parts if the caller passes one): the template decides.
        tools: OpenAI's tool list, for templates that render it (None: the template sees none).
        continue_final_message: the text ends with the final message's text, for the model to go on
        with it (no end of turn after it). chat_template_kwargs: more variables the template reads
        (vLLM's name; e.g. Qwen3's `enable_thinking`). An option the template would ignore is refused."""
        variables = chat_template_kwargs or {}
        self._check_variables(tools, variables)

        def render(conversation: list[dict]) -> str:
            return self._render(conversation, add_generation_prompt=add_generation_prompt, tools=tools, **variables)

        text = render(messages)
        return self._cut_after_final_message(text, messages, render) if continue_final_message else text

    def _render(self, messages: list[dict], **variables) -> str:
        try:
            return self._compile().render(messages=messages, **self._token_variables, **variables)
        except _TemplateRefusal as refusal:
            raise ChatTemplateError(f"{self.described} refused the conversation: "
                                    f"{refusal}") from None
        except Exception as error:  # anything the template trips on is the conversation's or the template's fault
            raise ChatTemplateError(f"{self.described} failed{_template_line(error)}: "
                                    f"{type(error).__name__}: {error}") from None

    def _check_variables(self, tools: list[dict] | None, variables: dict) -> None:
        """Tools and variables only where the template reads them: a template that never names one
        would render as if it were not there, and the caller would never know."""
        if tools and "tools" not in self._read_variables:
            raise InvalidParameterError(f"tools: {self.described} does not render tools")
        for name in variables:
            if name in self._set_variables:
                raise InvalidParameterError(f"chat_template_kwargs[{name!r}]: draftwise sets {name!r} itself"
                                            + (" (pass it as chat's own argument)" if name in CHAT_ARGUMENTS else ""))
            if name not in self._read_variables:
                raise InvalidParameterError(f"chat_template_kwargs[{name!r}]: {self.described} "
                                            f"reads no variable {name!r}")

    def _cut_after_final_message(self, text: str, messages: list[dict], render) -> str:
        """The rendering up to the end of the final message's text, its trailing whitespace kept only
        where the template kept it. Where the message ends is learnt from a second rendering with a
        marker in place of its text: what the template writes after the marker is what it wrote after
        the text (so a short text that also appears in the template's own later text, "im" in
        `<|im_end|>`, is cut in the right place). A template whose text after the message depends on
        the message falls back to transformers' rule: where the text last appears."""
        final = _final_text(messages[-1])
        marked = render([*messages[:-1], _with_final_text(messages[-1], FINAL_MARKER)])
        if marked.count(FINAL_MARKER) == 1:
            after = marked[marked.index(FINAL_MARKER) + len(FINAL_MARKER):]
            end = len(text) - len(after)
            if text.endswith(after) and text[:end].rstrip().endswith(final.strip()):
                return text[:end]
        start = text.rfind(final.strip())
        if start < 0:
            raise InvalidParameterError(f"continue_final_message: {self.described} does "
                                        "not write the final message's text as it is, so it cannot be continued")
        kept = final.lstrip()
        end = start + (len(kept) if text.startswith(kept, start) else len(final.strip()))
        return text[:end]

    @cached_property
    def _read_variables(self) -> frozenset[str]:
        """The names the template reads and does not set itself (Jinja's own analysis)."""
        environment = self._compile().environment
        return frozenset(meta.find_undeclared_variables(environment.parse(self.source)))

    @cached_property
    def _set_variables(self) -> frozenset[str]:
        """What rendering sets: the conversation, the tokens and the environment's functions."""
        return frozenset({*CHAT_ARGUMENTS, *self._token_variables, *self._compile().environment.globals})

    def check_syntax(self) -> None:
        """Raise ChatTemplateError now if the source does not parse (otherwise: at the first chat)."""
        self._compile()

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
                raise ChatTemplateError(f"{self.described} does not parse "
                                        f"(line {error.lineno}): {error.message}") from None
        return self._compiled


def _final_text(message: dict) -> str:
    """The text a continued message goes on from: its content, or its last text part."""
    content = message.get("content")
    if isinstance(content, list):
        texts = [part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)]
        content = texts[-1] if texts else None
    if not isinstance(content, str) or not content.strip():
        raise InvalidParameterError("continue_final_message: the final message has no text to continue")
    return content


def _with_final_text(message: dict, text: str) -> dict:
    """The message with `text` in place of the text `_final_text` reads."""
    content = message["content"]
    if isinstance(content, str):
        return {**message, "content": text}
    last = max(i for i, part in enumerate(content) if isinstance(part, dict) and isinstance(part.get("text"), str))
    return {**message, "content": [*content[:last], {**content[last], "text": text}, *content[last + 1:]]}


def _template_line(error: Exception) -> str:
    """' at line N' of the template where the error rose (Jinja maps its frames to template lines)."""
    line, trace = None, error.__traceback__
    while trace is not None:
        if trace.tb_frame.f_code.co_filename == "<template>":
            line = trace.tb_lineno
        trace = trace.tb_next
    return f" at line {line}" if line is not None else ""
