"""The structured workload: requests whose answers are held to a JSON Schema or a tool call, built
from the shared data (`datasets.py` finds the files). Four kinds, taken in turn:

- extraction: a HumanEval function described as JSON (nested objects, an array with bounds, a
  pattern, nullable fields);
- classification: a Spec-Bench question labelled (enums, a boolean, a bounded number);
- tool_call: a Spec-Bench question answered by calling one of three tools (tool_choice required:
  the call's name one of them, its arguments valid against that tool's schema);
- summary_card: a Spec-Bench article summarised as a card (nested object, arrays of enums and of
  bounded strings, a nullable date).

Each item is (kind, prompt text through the chat template, {"structured_outputs": ...}): what the
benchmark's configs take as a request with SamplingParams fields of its own.
"""

from __future__ import annotations

from draftwise.benchmark.datasets import _jsonl, _spec_bench_category, data_file
from draftwise.structured.tool_calls import Function, tool_call_grammar

IDENTIFIER = "^[A-Za-z_][A-Za-z0-9_]*$"
EXTRACTION = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": IDENTIFIER},
    "parameters": {"type": "array", "maxItems": 6, "items": {
        "type": "object", "properties": {"name": {"type": "string", "pattern": IDENTIFIER},
                                         "type": {"type": ["string", "null"], "maxLength": 40}},
        "required": ["name", "type"], "additionalProperties": False}},
    "returns": {"type": ["string", "null"], "maxLength": 40},
    "examples": {"type": "integer", "minimum": 0, "maximum": 20},
    "summary": {"type": "string", "maxLength": 200}},
    "required": ["name", "parameters", "returns", "examples", "summary"], "additionalProperties": False}
CLASSIFICATION = {"type": "object", "properties": {
    "task": {"enum": ["question_answering", "translation", "summarization", "math", "coding", "writing",
                      "reasoning", "other"]},
    "domain": {"enum": ["science", "history", "geography", "language", "mathematics", "technology", "everyday",
                        "other"]},
    "needs_calculation": {"type": "boolean"},
    "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["task", "domain", "needs_calculation", "confidence"], "additionalProperties": False}
SUMMARY_CARD = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 100},
    "people": {"type": "array", "maxItems": 5, "items": {"type": "string", "maxLength": 60}},
    "topics": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "enum": ["politics", "business", "sport", "science", "health", "culture", "technology", "crime", "other"]}},
    "sentiment": {"enum": ["positive", "neutral", "negative"]},
    "date": {"type": ["string", "null"], "format": "date"},
    "key_facts": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "string", "maxLength": 160}}},
    "required": ["title", "people", "topics", "sentiment", "date", "key_facts"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "web_search", "description": "Search the web", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 120},
                                         "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["query", "max_results"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression",
                                      "parameters": {"type": "object", "properties": {
                                          "expression": {"type": "string", "pattern": "^[0-9+*/(). -]{1,80}$"}},
                                          "required": ["expression"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 60},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
]
KINDS = ("extraction", "classification", "tool_call", "summary_card")


def structured_workload(tokenizer, count: int, tags_are_tokens: bool = True) -> list[tuple[str, str, dict]]:
    """`count` requests of each kind, kinds in turn (see the module's docstring)."""
    problems = _jsonl(data_file("humaneval"))
    questions = [row for row in _jsonl(data_file("spec-bench")) if _spec_bench_category(row["category"]) == "qa"]
    articles = [row for row in _jsonl(data_file("spec-bench"))
                if _spec_bench_category(row["category"]) == "summarization"]
    functions = [Function(tool["function"]["name"], tool["function"]["parameters"]) for tool in TOOLS]
    calls = {"grammar": tool_call_grammar(functions, required=True, parallel=False, tags_are_tokens=tags_are_tokens)}
    items = []
    for i in range(count):
        problem, question, article = problems[(11 * i) % len(problems)], questions[i % len(questions)], \
            articles[i % len(articles)]
        extraction = [{"role": "user", "content": "Describe this Python function as JSON (its name, parameters "
                                                  "with their types, return type, number of docstring examples, "
                                                  f"a one-sentence summary):\n```python\n{problem['prompt']}```"}]
        classification = [{"role": "user", "content": "Classify this request as JSON (task, domain, whether it "
                                                      f"needs calculation, your confidence):\n{question['turns'][0]}"}]
        tool_call = [{"role": "user", "content": question["turns"][0]}]
        card = [{"role": "user", "content": f"{article['turns'][0]}\n\nInstead of a summary, answer with a JSON card "
                                            "of this article: title, people named, topics, sentiment, date (or null), "
                                            "key facts."}]
        items += [("extraction", tokenizer.apply_chat_template(extraction), {"structured_outputs": {"json": EXTRACTION}}),
                  ("classification", tokenizer.apply_chat_template(classification),
                   {"structured_outputs": {"json": CLASSIFICATION}}),
                  ("tool_call", tokenizer.apply_chat_template(tool_call, tools=TOOLS),
                   {"structured_outputs": calls, "skip_special_tokens": False}),
                  ("summary_card", tokenizer.apply_chat_template(card), {"structured_outputs": {"json": SUMMARY_CARD}})]
    return items
