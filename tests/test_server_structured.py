"""Structured outputs and tools over HTTP, driven by the official `openai` client: OpenAI's
`response_format` (json_object, json_schema), vLLM's extra fields (`structured_outputs`, `guided_*`),
`tools` with every `tool_choice`, streamed and not, with speculation, each answer equal to the
constrained generation in-process, and malformed constraints refused with a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai")

from draftwise import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from draftwise.errors import InvalidParameterError  # noqa: E402
from draftwise.server.tools import plan_tools  # noqa: E402
from draftwise.structured.tool_calls import split_tool_calls  # noqa: E402
from tests.drafting import DRAFTING_PAYS  # noqa: E402
from tests.live_server import LiveServer  # noqa: E402

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# Room for any answer SCHEMA allows, so that a constrained answer always ends ("stop"), whatever the
# random model prefers: JSON whitespace is at most 32 characters in each of its 10 places (320 tokens at
# worst) and the rest under 100 tokens (a 10-character string of \\uXXXX escapes is 62).
GREEDY = dict(temperature=0, max_tokens=480)
# One call always ends inside this: its JSON has 20 places for whitespace (640 tokens at worst), the rest
# is under 150 tokens. (Parallel calls have no such bound: the random model may call again and again.)
CALLS = dict(temperature=0, max_tokens=900)


def build_llm(folder):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("draftwise.speculative.drafter.load_or_measure", lambda *args, **kwargs: DRAFTING_PAYS)
        return LLM(str(folder), max_model_len=2048, max_num_seqs=4, progress=False,
                   speculative={"method": "ngram", "num_speculative_tokens": 4})


@pytest.fixture(scope="module")
def server(tiny_tools):
    live = LiveServer(build_llm(tiny_tools), MODEL)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def reference(tiny_tools):
    return LLM(str(tiny_tools), max_model_len=2048, progress=False)


def chat_reference(reference, params: StructuredOutputsParams, tools=None, keep_special=False,
                   sampling=GREEDY) -> str:
    prompt = {"prompt_token_ids": reference.tokenizer.encode_chat(MESSAGES, tools=tools), "prompt": ""}
    return reference.generate(prompt, SamplingParams(**sampling, structured_outputs=params,
                                                     skip_special_tokens=not keep_special))[0].text


def test_response_format_json_schema_and_json_object(server, reference):
    client = server.client()
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY, response_format={
        "type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}})
    content = answer.choices[0].message.content
    jsonschema.validate(json.loads(content), SCHEMA)
    assert content == chat_reference(reference, StructuredOutputsParams(json=SCHEMA))
    assert answer.choices[0].finish_reason == "stop"
    anything = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=400,
                                              response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":  # (the random model may fill 400 tokens with whitespace)
        assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_streamed_constrained_answer_equals_the_whole_one(server):
    client = server.client()
    fields = dict(model=MODEL, messages=MESSAGES, **GREEDY,
                  response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": SCHEMA}})
    whole = client.chat.completions.create(**fields).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        **fields, stream=True) if chunk.choices)
    assert streamed == whole


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": r"[a-z]{3,8}@[a-z]{2,5}\.com"}, lambda text: "@" in text and text.endswith(".com")),
    ({"guided_choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
    ({"structured_outputs": {"grammar": 'root ::= "x=" [0-9]{1,3}'}}, lambda text: text.startswith("x=")),
    ({"guided_json": SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": SCHEMA}}},
     lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
])
def test_vllm_fields_on_completions(server, extra, check):
    answer = server.client().completions.create(model=MODEL, prompt="def add(a, b):", **GREEDY, extra_body=extra)
    assert answer.choices[0].finish_reason == "stop", answer.choices[0].text
    assert check(answer.choices[0].text)


def test_speculation_under_a_constraint_changes_nothing(server):
    client = server.client()
    fields = dict(model=MODEL, messages=MESSAGES, **GREEDY, response_format={
        "type": "json_schema", "json_schema": {"name": "f", "schema": SCHEMA}})
    plain = client.chat.completions.create(**fields, extra_body={"speculative": {"enabled": False}})
    drafted = client.chat.completions.create(**fields)
    assert drafted.choices[0].message.content == plain.choices[0].message.content
    assert drafted.usage.model_extra["speculation"]["num_draft_tokens"] > 0


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "Invalid type: strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "not supported"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "with a name"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "one output constraint"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs", "structured_outputs.regex"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs", "structured_outputs.jsonn is not supported"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "letters"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}],
      "tool_choice": "required"}, "tools", "Unimplemented keys"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages[0].tool_call_id", "tool_call_id is required"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs", "unknown name"),
    ({"guided_grammar": 'start: "a" (('}, "guided_grammar", "structured_outputs.grammar"),
])
def test_malformed_constraints_are_a_400_naming_the_field(server, body, param, message):
    response = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": MESSAGES, "max_tokens": 8, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param


# --- tools ----------------------------------------------------------------------------------------
def test_required_tool_calls_are_valid_calls_of_the_given_functions(server, reference):
    answer = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME],
                                                     tool_choice="required", parallel_tool_calls=False, **CALLS)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls and choice.message.content is None
    plan = plan_tools([WEATHER, TIME], "required", False, reference.tokenizer.chat_template)
    _, expected = split_tool_calls(chat_reference(reference, plan.constraint(tags_are_tokens=True), [WEATHER, TIME],
                                                  keep_special=True, sampling=CALLS))
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        (c.name, c.arguments) for c in expected]
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        schema = {"get_weather": SCHEMA, "get_time": TIME["function"]["parameters"]}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_named_function_is_the_one_called(server):
    answer = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], **CALLS, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = answer.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    assert json.loads(calls[0].function.arguments)["zone"] in ("UTC", "CET")


def test_streamed_tool_calls_add_up_to_the_whole_answer(server):
    client = server.client()
    fields = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required",
                  parallel_tool_calls=False, **CALLS)
    whole = client.chat.completions.create(**fields).choices[0]
    calls, reasons = {}, []
    for chunk in client.chat.completions.create(**fields, stream=True):
        if not chunk.choices:
            continue
        reasons.append(chunk.choices[0].finish_reason)
        for delta in chunk.choices[0].delta.tool_calls or []:
            calls.setdefault(delta.index, {"name": "", "arguments": ""})
            calls[delta.index]["name"] += delta.function.name or ""
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert [calls[i] for i in sorted(calls)] == [
        {"name": call.function.name, "arguments": call.function.arguments} for call in whole.message.tool_calls]
    assert reasons[-1] == "tool_calls"


def test_tool_choice_none_and_auto_answer_in_text(server):
    client = server.client()
    none = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="none",
                                          temperature=0, max_tokens=16)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")
    auto = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], temperature=0,
                                          max_tokens=16)
    message = auto.choices[0].message  # the random model writes text; a call it opened would be valid
    for call in message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_auto_reads_the_call_a_model_opens_and_streams_it(server, reference):
    """tool_choice auto: text or calls, as the model chooses. The random model is nudged to open a
    call at once and to end its turn after it (logit_bias on `<tool_call>`, less on `<|im_end|>`);
    the grammar holds what is inside the tags to one valid call."""
    token_id = reference.tokenizer.token_to_id
    bias = {str(token_id("<tool_call>")): 100, str(token_id("<|im_end|>")): 50}
    fields = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], parallel_tool_calls=False, logit_bias=bias, **CALLS)
    client = server.client()
    choice = client.chat.completions.create(**fields).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    streamed = [chunk.choices[0].delta for chunk in client.chat.completions.create(**fields, stream=True)
                if chunk.choices]
    deltas = [call for delta in streamed for call in delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [("get_weather", call.function.arguments)]
    assert not any("<tool_call>" in (delta.content or "") for delta in streamed)


def test_an_answer_that_cannot_finish_in_max_tokens_ends_with_length(server):
    answer = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                                     response_format={"type": "json_schema", "json_schema": {
                                                         "name": "weather", "schema": SCHEMA}})
    assert answer.choices[0].finish_reason == "length" and len(answer.choices[0].message.content) > 0


def test_a_conversation_with_a_call_and_its_result(server, reference):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 1})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    answer = server.client().chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                     tool_choice="none", temperature=0, max_tokens=12)
    rendered = reference.tokenizer.apply_chat_template([{**m} for m in messages[:1]] + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "days": 1}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}])
    assert '"arguments": {"city": "Paris", "days": 1}' in rendered and "sunny, 24 C" in rendered
    expected = reference.generate(rendered, SamplingParams(temperature=0, max_tokens=12))[0].text
    assert answer.choices[0].message.content == expected


def test_fill_in_the_middle_and_echo(server, reference):
    tokenizer = reference.tokenizer
    ids = tokenizer.fim_prompt("def add(a, b):\n    return ", "\n\nprint(add(1, 2))")
    assert ids[0] == tokenizer.token_to_id("<|fim_prefix|>") and ids[-1] == tokenizer.token_to_id("<|fim_middle|>")
    client = server.client()
    middle = client.completions.create(model=MODEL, prompt="def add(a, b):\n    return ", suffix="\n\nprint(add(1, 2))",
                                       temperature=0, max_tokens=8)
    expected = reference.generate({"prompt_token_ids": ids, "prompt": ""},
                                  SamplingParams(temperature=0, max_tokens=8))[0].text
    assert middle.choices[0].text == expected
    echoed = client.completions.create(model=MODEL, prompt="def add(a, b):", echo=True, temperature=0, max_tokens=6)
    plain = client.completions.create(model=MODEL, prompt="def add(a, b):", temperature=0, max_tokens=6)
    assert echoed.choices[0].text == "def add(a, b):" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="def add(a, b):", echo=True, temperature=0, max_tokens=6, stream=True) if c.choices)
    assert streamed == echoed.choices[0].text


def test_a_model_without_fim_tokens_refuses_suffix(tiny_qwen):
    live = LiveServer(LLM(str(tiny_qwen), max_model_len=256, progress=False), MODEL)
    try:
        response = httpx.post(live.url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "def f(", "suffix": ")", "max_tokens": 4})
        assert response.status_code == 400 and "fill-in-the-middle" in response.json()["error"]["message"]
        with pytest.raises(InvalidParameterError, match="fill-in-the-middle tokens"):  # (the library says so too)
            live.llm.tokenizer.fim_prompt("def f(", ")")
    finally:
        live.stop()
