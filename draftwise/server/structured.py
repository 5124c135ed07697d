"""A request body's output constraint: OpenAI's `response_format`, or vLLM's extensions
(`structured_outputs`, and the older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`). At most one may be given; anything malformed is a 400 naming the field."""

from __future__ import annotations

from draftwise.errors import InvalidParameterError
from draftwise.sampling.structured_params import StructuredOutputsParams
from draftwise.server.protocol import SamplingFields

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


class StructuredRequestError(Exception):
    """A malformed constraint; the caller turns it into a 400 naming `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def requested_structure(body: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint the body asks for and the field that asked (None, None: free text)."""
    given = [name for name in ("response_format", "structured_outputs", *GUIDED) if getattr(body, name) is not None]
    if body.response_format == {"type": "text"}:
        given.remove("response_format")
    if len(given) > 1:
        raise StructuredRequestError(f"give one output constraint, not {' and '.join(given)}", given[1])
    if not given:
        return None, None
    field = given[0]
    try:
        if field == "response_format":
            return _response_format(body.response_format), field
        if field == "structured_outputs":
            return StructuredOutputsParams.from_value(body.structured_outputs), field
        return StructuredOutputsParams(**{GUIDED[field]: getattr(body, field)}), field
    except InvalidParameterError as error:
        raise StructuredRequestError(str(error), field) from None


def _response_format(value: dict) -> StructuredOutputsParams:
    kind = value.get("type")
    if kind == "json_object" and set(value) == {"type"}:
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        unknown = sorted(set(value) - {"type", "json_schema"})
        if unknown:
            raise StructuredRequestError(f"response_format.{unknown[0]} is not a field of a json_schema format",
                                         f"response_format.{unknown[0]}")
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise StructuredRequestError("response_format.json_schema must be an object with a name",
                                         "response_format.json_schema")
        unknown = sorted(set(spec) - JSON_SCHEMA_KEYS)
        if unknown:
            raise StructuredRequestError(f"response_format.json_schema.{unknown[0]} is not supported",
                                         f"response_format.json_schema.{unknown[0]}")
        if spec.get("strict") not in (None, True, False):
            raise StructuredRequestError("response_format.json_schema.strict must be true or false",
                                         "response_format.json_schema.strict")
        schema = spec.get("schema", {})  # (OpenAI: absent means any JSON)
        if not isinstance(schema, dict):
            raise StructuredRequestError("response_format.json_schema.schema must be a JSON Schema object",
                                         "response_format.json_schema.schema")
        return StructuredOutputsParams(json=schema)  # followed exactly, strict or not
    if kind in ("json_object", "text"):
        raise StructuredRequestError(f"response_format of type {kind!r} takes no other field", "response_format")
    raise StructuredRequestError(f"response_format.type {kind!r} is not supported: text, json_object or json_schema",
                                 "response_format.type")
