"""What a request's output must match: vLLM's `StructuredOutputsParams` (same field names), checked
when made. Exactly one constraint: a JSON Schema (`json`), any JSON object (`json_object`), a
regular expression (`regex`), one of some strings (`choice`) or a grammar (`grammar`: Lark, or
GBNF / EBNF with `::=` rules). Compiling it against the model's vocabulary is `draftwise.structured`'s
job; a grammar that does not compile is refused there, naming the problem."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from draftwise.errors import InvalidParameterError, check_text

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON Schema, as a dict or as JSON text
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None  # Lark, or GBNF (rules written `name ::= ...`)
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool = False  # JSON without optional whitespace (vLLM's flag)
    structural_tag: str | None = None  # vLLM's structural tags: refused by name (not implemented)

    def __post_init__(self) -> None:
        if self.structural_tag is not None:
            raise InvalidParameterError("structured_outputs.structural_tag is not supported; use grammar, json, "
                                        "regex, choice or json_object (or tools on the chat endpoint)")
        if self.json is False:
            raise InvalidParameterError("structured_outputs.json is false: a JSON Schema that no value satisfies")
        given = [name for name in CONSTRAINTS if _given(getattr(self, name))]
        if len(given) != 1:
            raise InvalidParameterError("structured_outputs needs exactly one of " + ", ".join(CONSTRAINTS)
                                        + (f"; got {', '.join(given)}" if given else "; got none"))
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidParameterError("structured_outputs.disable_any_whitespace must be true or false")
        if self.json_object not in (None, True, False):
            raise InvalidParameterError("structured_outputs.json_object must be true or false")
        if self.json is not None:
            object.__setattr__(self, "json", _schema(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidParameterError(f"structured_outputs.{name} must be a non-empty string")
            if value is not None:
                check_text(value, f"structured_outputs.{name}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or any(not isinstance(c, str) or not c for c in self.choice):
                raise InvalidParameterError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(check_text(c, "structured_outputs.choice") for c in self.choice))

    @property
    def kind(self) -> str:
        """Which constraint this is: one of CONSTRAINTS."""
        return next(name for name in CONSTRAINTS if _given(getattr(self, name)))

    @classmethod
    def from_value(cls, value: "StructuredOutputsParams | dict | None") -> "StructuredOutputsParams | None":
        """The params from themselves or from a dict of their fields (an unknown key is refused by name)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidParameterError("structured_outputs must be a StructuredOutputsParams or a dict of its "
                                        f"fields, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidParameterError(f"structured_outputs.{unknown[0]} is not supported; known fields: "
                                        + ", ".join(sorted(known)))
        return cls(**value)


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name (SamplingParams.guided_decoding)


def _given(value) -> bool:
    """A constraint field set (json_object=False is the flag off; json=0 is a value, refused as a schema)."""
    return value is not None and value is not False


def _schema(value: str | dict) -> dict:
    """A JSON Schema as a dict (given as a dict, or as JSON text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise InvalidParameterError(f"structured_outputs.json is not valid JSON: {error.msg} at character "
                                        f"{error.pos}") from None
    if not isinstance(value, dict) and not isinstance(value, bool):
        raise InvalidParameterError("structured_outputs.json must be a JSON Schema (an object)")
    if isinstance(value, bool):
        value = {} if value else {"not": {}}
    return value
