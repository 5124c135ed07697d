"""Tools on the chat endpoint: the request's `tools` / `tool_choice` / `parallel_tool_calls` checked
and planned (what the chat template renders, which constraint the answer follows), conversation
messages that carry calls and their results, and the answer's calls read back as OpenAI
`tool_calls`, whole or streamed as deltas."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from draftwise.sampling.structured_params import StructuredOutputsParams
from draftwise.structured.tool_calls import (Function, ToolCall, holdback, split_tool_calls, template_calls_tools,
                                             tool_call_grammar)

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolRequestError(Exception):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: list[dict]  # what the chat template renders (OpenAI's shape)
    functions: list[Function]  # the ones the answer may call
    required: bool  # the answer is calls only (tool_choice "required" or a named function)
    parallel: bool

    def constraint(self, tags_are_tokens: bool) -> StructuredOutputsParams:
        return StructuredOutputsParams(grammar=tool_call_grammar(self.functions, self.required, self.parallel,
                                                                 tags_are_tokens))


def plan_tools(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool | None,
               chat_template: str | None) -> ToolPlan | None:
    """The plan for a request's tools; None where the answer calls none (no tools, or tool_choice
    "none": then the tools are not rendered either, so the model is not told of calls it may not make)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolRequestError("tool_choice needs tools", "tool_choice")
        return None
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise ToolRequestError("two tools share a function name", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if isinstance(choice, dict):
        name = _named_choice(choice)
        if name not in names:
            raise ToolRequestError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        functions, required = [functions[names.index(name)]], True
    elif choice in ("auto", "required"):
        required = choice == "required"
    else:
        raise ToolRequestError(f"tool_choice {choice!r} is not one of none, auto, required or a named function",
                               "tool_choice")
    if not template_calls_tools(chat_template):
        raise ToolRequestError("this model's chat template has no tool-call format draftwise knows (Hermes "
                               "<tool_call> blocks, as Qwen2.5's); send tool_choice none", "tools")
    return ToolPlan(list(tools), functions, required, parallel_tool_calls is not False)


def _function(tool: dict, index: int) -> Function:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) != {"type", "function"}:
        raise ToolRequestError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}} (other tool "
                               "types are not supported)", where)
    spec = tool["function"]
    if not isinstance(spec, dict):
        raise ToolRequestError(f"{where}.function must be an object", f"{where}.function")
    unknown = sorted(set(spec) - FUNCTION_KEYS)
    if unknown:
        raise ToolRequestError(f"{where}.function.{unknown[0]} is not a field of a function", f"{where}.function")
    if not isinstance(spec.get("name"), str) or not NAME.match(spec["name"]):
        raise ToolRequestError(f"{where}.function.name must be 1-64 letters, digits, _ or -", f"{where}.function.name")
    if "description" in spec and not isinstance(spec["description"], str):
        raise ToolRequestError(f"{where}.function.description must be a string", f"{where}.function.description")
    parameters = spec.get("parameters", EMPTY_PARAMETERS)
    if not isinstance(parameters, dict):
        raise ToolRequestError(f"{where}.function.parameters must be a JSON Schema object",
                               f"{where}.function.parameters")
    return Function(spec["name"], parameters)


def _named_choice(choice: dict) -> str:
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                               '"function": {"name": ...}}', "tool_choice")
    return function["name"]


# --- messages that carry calls and results --------------------------------------------------------
def assistant_calls(calls: list, where: str) -> list[dict]:
    """An assistant message's `tool_calls` as chat templates read them (arguments as an object)."""
    rendered = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or call.get("type", "function") != "function"
                or not isinstance(function.get("name"), str) or not isinstance(function.get("arguments"), str)):
            raise ToolRequestError(f"{where}.tool_calls[{j}] must be {{\"id\", \"type\": \"function\", \"function\": "
                                   "{\"name\", \"arguments\": JSON text}}", f"{where}.tool_calls[{j}]")
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError:
            arguments = function["arguments"]
        rendered.append({"id": call.get("id"), "type": "function",
                         "function": {"name": function["name"], "arguments": arguments}})
    return rendered


# --- answers --------------------------------------------------------------------------------------
def call_dicts(calls: list[ToolCall], first_index: int = 0) -> list[dict]:
    return [{"index": first_index + i, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}} for i, call in enumerate(calls)]


def answer_message(text: str) -> tuple[dict, bool]:
    """The assistant message of a finished answer ({"role", "content", "tool_calls"}), and whether
    it calls tools (then its finish_reason is "tool_calls")."""
    content, calls = split_tool_calls(text)
    if not calls:
        return {"role": "assistant", "content": text}, False
    tool_calls = [{key: value for key, value in call.items() if key != "index"} for call in call_dicts(calls)]
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}, True


class ToolCallStream:
    """A streamed answer's text turned into chat deltas: content until a call opens, then each call
    as one `tool_calls` delta once its block is complete."""

    def __init__(self) -> None:
        self.text = ""
        self._sent = 0  # characters of content sent
        self._calls = 0  # calls sent
        self._in_calls = False

    def feed(self, delta: str, finished: bool) -> list[dict]:
        self.text += delta
        deltas = []
        if not self._in_calls:
            start = self.text.find("<tool_call>")
            end = start if start >= 0 else len(self.text) - (0 if finished else holdback(self.text))
            if end > self._sent:
                deltas.append({"content": self.text[self._sent:end]})
                self._sent = end
            self._in_calls = start >= 0
        if self._in_calls:
            _, calls = split_tool_calls(self.text)
            if len(calls) > self._calls:
                deltas.append({"tool_calls": call_dicts(calls[self._calls:], self._calls)})
                self._calls = len(calls)
        if finished and self._calls == 0 and len(self.text) > self._sent:  # (a call cut off, by max_tokens say:
            deltas.append({"content": self.text[self._sent:]})  # its text is the answer, as `answer_message` says)
            self._sent = len(self.text)
        return deltas

    @property
    def called(self) -> bool:
        return self._calls > 0
