"""Tool calls in the format the Qwen2.5 (Hermes-style) chat templates teach the model:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one such block per call. `tool_call_grammar` constrains an answer to it (each call's name one of the
functions, its arguments valid against that function's `parameters` schema); `split_tool_calls`
reads the calls back out of a finished text. Where `<tool_call>` is a special token the grammar
names the token itself: free text before a call can never spell it, so `auto` lets the model write
text and then, once it opens a call, holds the call to the schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from draftwise.structured.grammars import JSON_WHITESPACE

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    parameters: dict  # a JSON Schema for the arguments object


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


def template_calls_tools(chat_template: str | None) -> bool:
    """The chat template renders tools and teaches this call format."""
    return bool(chat_template) and OPEN in chat_template and "tools" in chat_template


def tool_call_grammar(functions: list[Function], required: bool, parallel: bool, tags_are_tokens: bool) -> str:
    """A Lark grammar (llguidance's dialect) for answers that call these functions.

    required: only calls (one, or several on their own lines when parallel); else text, with calls
    wherever the model opens one (at most one unless parallel). tags_are_tokens: `<tool_call>` and
    `</tool_call>` are special tokens of the vocabulary (named as tokens; else matched as text)."""
    open_tag, close_tag = (OPEN, CLOSE) if tags_are_tokens else (json.dumps(OPEN), json.dumps(CLOSE))
    rules = [f'call: {open_tag} "\\n" ({" | ".join(f"fn_{i}" for i in range(len(functions)))}) "\\n" {close_tag}']
    for i, function in enumerate(functions):
        rules.append(f"fn_{i}: %json {json.dumps(call_schema(function), ensure_ascii=False)}")
    if required:
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
    else:
        start = "start: TEXT (call TEXT)*" if parallel else "start: TEXT (call TEXT)?"
        rules.append("TEXT: /(.|\\n)*/")
    return "%llguidance {}\n" + "\n".join([start, *rules]) + "\n"


def call_schema(function: Function) -> dict:
    """The JSON of one call: {"name": <this function>, "arguments": <its parameters>}."""
    return {"type": "object", "properties": {"name": {"const": function.name}, "arguments": function.parameters},
            "required": ["name", "arguments"], "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE, "lenient": False}}


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the text before the calls, the calls) of a finished answer: where one is, the content ends at
    the first `<tool_call>`, as a stream's does (`ToolCallStream`), its whitespace kept (vLLM's
    Hermes parser keeps it). A block that is not a call (not JSON, no name) is no call; without any
    call the whole text is the content: only what the grammar produced is read as a call."""
    calls = [call for call in map(_read_call, (match.group(1) for match in _BLOCK.finditer(text))) if call is not None]
    if not calls:
        return text, []
    return text[:text.find(OPEN)], calls


def _read_call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(value["name"], text)


def holdback(text: str) -> int:
    """How many characters at the end of a streamed text could be the start of `<tool_call>` (held
    back from the stream until the next delta says which)."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0
