"""From what a request asks (`StructuredOutputsParams`) to an llguidance grammar definition.

llguidance was chosen over xgrammar by measurement (BENCHMARKS.md, "Grammar engines", an AMD EPYC):
both mask the Qwen vocabulary in a fraction of a millisecond a token (mean 0.07 ms against 0.16 ms),
but llguidance reaches a first mask of a workload schema in ~1 ms where xgrammar compiles for ~3.6 s
(median), it refuses the JSON Schema keywords it does not implement by name where xgrammar compiled
four of them into a looser grammar, and it needs no transformers at run time.
"""

from __future__ import annotations

import json

import llguidance

from draftwise.errors import InvalidParameterError
from draftwise.sampling.structured_params import StructuredOutputsParams

ANY_JSON_OBJECT = {"type": "object"}


def grammar_definition(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) for the constraint; InvalidParameterError naming the
    field where the text cannot even be read (a grammar that reads but does not compile is found
    by `GrammarCompiler`)."""
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = params.json if kind == "json" else ANY_JSON_OBJECT
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=json_options(params))
        if kind == "regex":
            return llguidance.grammar_from("regex", params.regex)
        if kind == "choice":
            return llguidance.grammar_from("lark", choice_lark(params.choice))
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as error:
        raise InvalidParameterError(f"structured_outputs.{kind}: {error}") from None


# Whitespace between JSON tokens when the model chooses it: enough for a pretty-printed document
# (a newline and indentation), bounded so that a model cannot fill max_tokens with blanks (the
# failure unbounded JSON whitespace is known for).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,32}"


def json_options(params: StructuredOutputsParams) -> dict:
    """Whitespace between JSON tokens: the model's choice (any JSON whitespace, up to 32 characters
    at a time), or none at all with disable_any_whitespace. Unimplemented keywords are refused,
    never ignored."""
    if params.disable_any_whitespace:
        return {"whitespace_flexible": False, "lenient": False}
    return {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE, "lenient": False}


def choice_lark(choices: tuple[str, ...]) -> str:
    """A Lark grammar whose only sentences are the given strings."""
    return "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices) + "\n"
