"""`--suite grammar-engines`: the two grammar engines the ecosystem offers, measured on the target's
vocabulary: llguidance (what draftwise uses: `draftwise.structured`) and xgrammar (`pip install
xgrammar`; shown as not run without it), with llguidance again as the control.

Per engine, interleaved repeat by repeat (the first rotating): building its view of the tokenizer;
compiling each schema of the structured workload (cold: no cache) up to its first mask; and the mask
per token while walking a valid answer of each schema token by token (the cost a constrained decoding
step pays). Then JSON Schema coverage: for each feature, a schema using it, an instance that follows
it and one that breaks it: "enforced" (the first accepted, the second refused), "refused" (the engine
declines the schema, naming the keyword), or what went wrong ("loosened": the breaking instance was
accepted, i.e. the engine compiled a looser grammar than the schema says, silently).
"""

from __future__ import annotations

import json
import statistics
import time

from draftwise.benchmark.report import SuiteReport, table
from draftwise.benchmark.structured_workload import CLASSIFICATION, EXTRACTION, SUMMARY_CARD
from draftwise.benchmark.suites import BenchSettings
from draftwise.benchmark.suites.speculative import tokenizer_of

REPEATS = 5
INSTANCES = {
    "extraction": (EXTRACTION, {"name": "has_close_elements", "parameters": [
        {"name": "numbers", "type": "List[float]"}, {"name": "threshold", "type": "float"}], "returns": "bool",
        "examples": 2, "summary": "Whether any two numbers are closer to each other than the threshold."}),
    "classification": (CLASSIFICATION, {"task": "question_answering", "domain": "history",
                                        "needs_calculation": False, "confidence": 0.85}),
    "summary_card": (SUMMARY_CARD, {"title": "Council approves the new bridge", "people": ["Ana Ruiz", "Tom Lee"],
                                    "topics": ["politics", "business"], "sentiment": "neutral", "date": "2024-03-05",
                                    "key_facts": ["The vote was 7 to 2.", "Work starts in May."]}),
}


def _object(props: dict, **more) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False, **more}


FEATURES = {  # name: (schema, an instance that follows it, one that breaks it)
    "enum": (_object({"c": {"enum": ["red", "green"]}}), {"c": "red"}, {"c": "blue"}),
    "const": (_object({"c": {"const": 5}}), {"c": 5}, {"c": 6}),
    "nullable (type list)": (_object({"c": {"type": ["string", "null"]}}), {"c": None}, {"c": 1}),
    "integer bounds": (_object({"c": {"type": "integer", "minimum": 1, "maximum": 9}}), {"c": 3}, {"c": 12}),
    "exclusive bounds": (_object({"c": {"type": "number", "exclusiveMinimum": 0}}), {"c": 0.5}, {"c": -1}),
    "string length": (_object({"c": {"type": "string", "minLength": 2, "maxLength": 3}}), {"c": "ab"},
                      {"c": "abcd"}),
    "pattern": (_object({"c": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}}), {"c": "555-1234"},
                {"c": "5551234"}),
    "format: date": (_object({"c": {"type": "string", "format": "date"}}), {"c": "2024-01-31"}, {"c": "yesterday"}),
    "format: email": (_object({"c": {"type": "string", "format": "email"}}), {"c": "a@b.com"}, {"c": "nope"}),
    "array bounds": (_object({"c": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}}),
                     {"c": [1]}, {"c": [1, 2, 3]}),
    "anyOf": (_object({"c": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}}), {"c": True}, {"c": "x"}),
    "oneOf": (_object({"c": {"oneOf": [{"type": "integer"}, {"type": "string"}]}}), {"c": "x"}, {"c": None}),
    "allOf": (_object({"c": {"allOf": [{"type": "integer"}, {"minimum": 3}]}}), {"c": 4}, {"c": 1}),
    "$ref / $defs": ({"$defs": {"p": _object({"x": {"type": "integer"}})}, **_object({"c": {"$ref": "#/$defs/p"}})},
                     {"c": {"x": 1}}, {"c": {"x": "a"}}),
    "recursive $ref": ({"$defs": {"n": _object({"v": {"type": "integer"}, "next": {
        "anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}})}, "$ref": "#/$defs/n"},
                       {"v": 1, "next": {"v": 2, "next": None}}, {"v": 1, "next": {"v": "x", "next": None}}),
    "additionalProperties: schema": ({"type": "object", "additionalProperties": {"type": "integer"}}, {"a": 1},
                                     {"a": "x"}),
    "optional property": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "required": ["a"], "additionalProperties": False}, {"a": 1}, {"b": 1}),
    "multipleOf": (_object({"c": {"type": "integer", "multipleOf": 5}}), {"c": 10}, {"c": 7}),
    "patternProperties": ({"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                           "additionalProperties": False}, {"x_a": 1}, {"y": 1}),
    "uniqueItems": (_object({"c": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}),
                    {"c": [1, 2]}, {"c": [1, 1]}),
    "not": (_object({"c": {"not": {"type": "string"}}}), {"c": 1}, {"c": "x"}),
    "if / then": (_object({"c": {"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 5}}}), {"c": 10},
                  {"c": 7}),
    "contains": (_object({"c": {"type": "array", "contains": {"const": 1}}}), {"c": [1]}, {"c": [2]}),
}


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance

        self.module, self.tokenizer = llguidance, tokenizer
        started = time.perf_counter()
        self.lltokenizer = llguidance.LLTokenizer(tokenizer.path.read_text(encoding="utf-8"), n_vocab=vocab_size,
                                                  eos_token=sorted(tokenizer.eos_token_ids))
        self.tokenizer_seconds = time.perf_counter() - started

    def compile(self, schema: dict):
        """A matcher at the schema's start, its first mask computed; None where it is refused."""
        import llguidance.torch

        grammar = self.module.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})
        is_error, _ = self.module.LLMatcher.validate_grammar_with_warnings(grammar, self.lltokenizer)
        if is_error:
            return None
        matcher = self.module.LLMatcher(self.lltokenizer, grammar, log_level=0)
        self._mask = llguidance.torch.allocate_token_bitmask(1, self.lltokenizer.vocab_size)
        llguidance.torch.fill_next_token_bitmask(matcher, self._mask)
        return matcher

    def mask(self, matcher) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(matcher, self._mask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def accepts_whole(self, matcher, ids: list[int]) -> bool:
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar

        self.module, self.tokenizer = xgrammar, tokenizer
        started = time.perf_counter()
        vocab = [token or "" for token in tokenizer.id_to_token_list()]
        vocab += [""] * (vocab_size - len(vocab))
        info = xgrammar.TokenizerInfo.from_vocab_and_metadata(vocab, json.dumps({
            "vocab_type": 2, "vocab_size": vocab_size, "add_prefix_space": False,
            "stop_token_ids": sorted(tokenizer.eos_token_ids)}))  # 2: byte-level BPE
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.tokenizer_seconds = time.perf_counter() - started
        self._mask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self.eos = min(tokenizer.eos_token_ids)

    def compile(self, schema: dict):
        try:
            compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)
        except Exception:  # (it raises RuntimeError or ValueError, depending on the version)
            return None
        matcher = self.module.GrammarMatcher(compiled)
        matcher.fill_next_token_bitmask(self._mask)
        return matcher

    def mask(self, matcher) -> None:
        matcher.fill_next_token_bitmask(self._mask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def accepts_whole(self, matcher, ids: list[int]) -> bool:
        return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(self.eos)


def run(settings: BenchSettings) -> SuiteReport:
    from draftwise.loading.hf_folder import read_config
    from draftwise.loading.resolve import resolve_model

    tokenizer = tokenizer_of(settings.model)
    vocab_size = read_config(resolve_model(settings.model, progress=False)).vocab_size
    engines, absent = [Llguidance(tokenizer, vocab_size)], {}
    try:
        engines.append(Xgrammar(tokenizer, vocab_size))
    except ImportError:
        absent["xgrammar"] = "not installed: pip install xgrammar"
    control = Llguidance(tokenizer, vocab_size)
    control.name = "llguidance (control)"
    engines.append(control)
    walks = {kind: (schema, tokenizer.encode(json.dumps(instance))) for kind, (schema, instance) in INSTANCES.items()}
    compile_s: dict[str, list[float]] = {e.name: [] for e in engines}
    mask_s: dict[str, list[float]] = {e.name: [] for e in engines}
    for repeat in range(REPEATS):
        for e in engines[repeat % len(engines):] + engines[:repeat % len(engines)]:
            for schema, ids in walks.values():
                started = time.perf_counter()
                matcher = e.compile(schema)
                compile_s[e.name].append(time.perf_counter() - started)
                for token in ids:
                    started = time.perf_counter()
                    e.mask(matcher)
                    mask_s[e.name].append(time.perf_counter() - started)
                    if not e.accept(matcher, token):
                        raise RuntimeError(f"{e.name} refused a valid answer of a workload schema")
    rows = [[e.name, f"{e.tokenizer_seconds * 1e3:.0f}", f"{statistics.median(compile_s[e.name]) * 1e3:.1f}",
             f"{max(compile_s[e.name]) * 1e3:.1f}", f"{statistics.median(mask_s[e.name]) * 1e3:.3f}",
             f"{statistics.mean(mask_s[e.name]) * 1e3:.3f}",
             f"{sorted(mask_s[e.name])[int(0.99 * len(mask_s[e.name]))] * 1e3:.3f}"] for e in engines]
    rows += [[name, f"not run ({why})", *["-"] * 5] for name, why in absent.items()]
    coverage = {e.name: {name: feature_result(e, tokenizer, *case) for name, case in FEATURES.items()}
                for e in engines[:-1]}
    names = list(coverage)
    text = "\n\n".join([
        f"{settings.model}'s vocabulary ({vocab_size} ids). Schemas: the structured workload's "
        f"({', '.join(INSTANCES)}), {REPEATS} repeats, engines interleaved. Mask: one token mask, walking a "
        "valid answer token by token.",
        table(["engine", "tokenizer ms", "compile + first mask ms (median)", "max", "mask ms (median)", "mean",
               "p99"], rows),
        "JSON Schema features (a schema using each; an instance that follows it and one that breaks it):",
        table(["feature", *names], [[name, *(coverage[e][name] for e in names)] for name in FEATURES])])
    data = {"compile_seconds": compile_s, "mask_seconds": mask_s, "coverage": coverage, "absent": absent}
    return SuiteReport("grammar-engines", text, data)


def feature_result(engine, tokenizer, schema: dict, follows, breaks) -> str:
    if engine.compile(schema) is None:
        return "refused"
    accepted = engine.accepts_whole(engine.compile(schema), tokenizer.encode(json.dumps(follows)))
    refused = not engine.accepts_whole(engine.compile(schema), tokenizer.encode(json.dumps(breaks)))
    if accepted and refused:
        return "enforced"
    return "loosened" if accepted else ("valid instance refused" if refused else "valid refused, invalid accepted")
