"""Structured outputs: the constraint's parameters, its compilation (errors named, nothing loosened),
outputs that match it, and speculation under it, lossless: greedy output token-identical to plain
constrained decoding for every drafter, alone and batched beside free requests, and equal to a
reference written here (a teacher-forced forward, masked by a matcher of the test's own)."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import llguidance.torch
import pytest
import torch

from draftwise import LLM, SamplingParams, StructuredOutputsParams
from draftwise.errors import InvalidParameterError
from draftwise.structured.grammars import grammar_definition
from draftwise.structured.masks import allowed_tokens, fill_masks
from tests.drafting import DRAFTERS, assert_drafted, spec_totals

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "kind": {"enum": ["quicksort_function", "numpy_array_zeros"]},
    "sizes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1,
              "maxItems": 3},
    "note": {"type": ["string", "null"], "maxLength": 8}},
    "required": ["name", "kind", "sizes", "note"], "additionalProperties": False}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "compact json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"(def|for) [a-z_]{1,12}\((a|b|i)\):"),
    "choice": StructuredOutputsParams(choice=["quicksort", "numpy zeros", "lazy dog"]),
    "grammar": StructuredOutputsParams(grammar='start: "x = " NUMBER (" + " NUMBER){0,4}\nNUMBER: /[0-9]{1,3}/\n'),
    "gbnf": StructuredOutputsParams(grammar='root ::= "print(" [a-z]{1,12} ")"'),
}
PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):\n    print(", "import numpy as np\n"]


def greedy(constraint: str, max_tokens: int | None = None) -> SamplingParams:
    """Room for the random model's choices: it loves JSON's optional whitespace (up to 32 characters
    a gap, one at a time)."""
    default = {"json": 240, "json_object": 240, "compact json": 200}.get(constraint, 120)
    return SamplingParams(temperature=0, max_tokens=max_tokens or default, structured_outputs=CONSTRAINTS[constraint])


@pytest.fixture(scope="module")
def plain(tiny_qwen):
    return LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False)


def assert_matches(constraint: str, text: str) -> None:
    params = CONSTRAINTS[constraint]
    if params.kind == "json":
        jsonschema.validate(json.loads(text), params.json)
    elif params.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif params.kind == "regex":
        assert re.fullmatch(params.regex, text), text
    elif params.kind == "choice":
        assert text in params.choice
    elif constraint == "grammar":
        assert re.fullmatch(r"x = [0-9]{1,3}( \+ [0-9]{1,3}){0,4}", text), text
    else:
        assert re.fullmatch(r"print\([a-z]{1,12}\)", text), text


# --- parameters and compilation -----------------------------------------------------------------
@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of"),
    ({"json": SCHEMA, "regex": "a+"}, "got json, regex"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": "abc"}, "choice must be a non-empty list"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"structural_tag": "{}", "json_object": True}, "structural_tag is not supported"),
    ({"json_object": True, "disable_any_whitespace": "yes"}, "disable_any_whitespace must be"),
])
def test_bad_parameters_are_refused_by_name(fields, message):
    with pytest.raises(InvalidParameterError, match=re.escape(message)):
        StructuredOutputsParams(**fields)


def test_a_dict_is_taken_and_an_unknown_field_refused():
    params = SamplingParams(structured_outputs={"regex": "a+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="a+")
    with pytest.raises(InvalidParameterError, match="structured_outputs.guided_json is not supported"):
        SamplingParams(structured_outputs={"guided_json": SCHEMA})


@pytest.mark.parametrize("params, message", [
    (StructuredOutputsParams(regex="[0-9]+("), "structured_outputs.regex: .*unclosed group"),
    (StructuredOutputsParams(grammar="start: missing_rule"), "structured_outputs.grammar: .*unknown name"),
    (StructuredOutputsParams(json={"type": "strin"}), "structured_outputs.json: Invalid type: strin"),
    (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "Unimplemented keys: .*uniqueItems"),
    (StructuredOutputsParams(json={"type": "string", "format": "colour"}), "Unknown format: colour"),
    (StructuredOutputsParams(json={"not": {"type": "string"}}), "Unimplemented keys: .*not"),
])
def test_what_does_not_compile_is_refused_naming_the_problem(plain, params, message):
    """Nothing is loosened: a schema keyword llguidance does not enforce is refused, not ignored."""
    with pytest.raises(InvalidParameterError, match=message):
        plain.generate("def", SamplingParams(max_tokens=4, structured_outputs=params))
    assert not plain.has_unfinished_requests()


def test_compiled_grammars_are_cached(plain):
    params = StructuredOutputsParams(json={"type": "object", "properties": {"cached": {"type": "integer"}}})
    assert plain.grammars.compile(params) is plain.grammars.compile(StructuredOutputsParams(json=params.json))


def test_masks_through_a_draft_equal_a_matcher_stepped_by_hand(plain):
    """Position i's mask is the grammar's after the draft's first i tokens; after a token the grammar
    refuses, every token stays allowed (verification stops there anyway)."""
    grammar = plain.grammars.request_grammar(StructuredOutputsParams(regex="ab+c"))
    vocab = plain.model.config.vocab_size
    ids = [plain.tokenizer.encode(t)[0] for t in ("a", "b", "b", "x", "c")]
    allowed = allowed_tokens(fill_masks([(grammar, ids)], len(ids) + 1, vocab), vocab)  # [6, V]
    by_hand = plain.grammars.request_grammar(StructuredOutputsParams(regex="ab+c")).matcher
    one = llguidance.torch.allocate_token_bitmask(1, vocab)
    for position in range(4):  # after "", "a", "ab", "abb"
        llguidance.torch.fill_next_token_bitmask(by_hand, one)
        assert torch.equal(allowed[position], allowed_tokens(one, vocab)[0])
        assert allowed[position].sum() < vocab
        if position < 3:
            assert by_hand.consume_token(ids[position])
    assert allowed[4:].all()  # past "x", which "abb" may not be followed by
    assert grammar.num_consumed == 0 and grammar.valid_prefix(ids) == 3  # the matcher itself did not move


# --- outputs ------------------------------------------------------------------------------------
def reference(llm: LLM, prompt: str, params: SamplingParams) -> list[int]:
    """Plain constrained greedy decoding written out here: a full forward over prompt + output, the
    allowed tokens from a matcher of the test's own, the argmax among them."""
    vocab = llm.model.config.vocab_size
    tokenizer = llguidance.LLTokenizer(llm.tokenizer.path.read_text(), n_vocab=vocab,
                                       eos_token=sorted(llm.tokenizer.eos_token_ids))
    matcher = llguidance.LLMatcher(tokenizer, grammar_definition(params.structured_outputs))
    ids, output = llm.tokenizer.encode(prompt), []
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    while len(output) < min(params.max_tokens, llm.max_model_len - len(ids)):
        with torch.no_grad():
            tokens = torch.tensor([ids + output])
            logits = llm.model(tokens, torch.arange(tokens.shape[1])[None])[0, -1].float()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
        token = int(logits.masked_fill(~allowed_tokens(bitmask, vocab)[0], float("-inf")).argmax())
        output.append(token)
        assert matcher.consume_token(token)
        if token in llm.tokenizer.eos_token_ids:
            break
    return output


@pytest.mark.parametrize("constraint", list(CONSTRAINTS))
def test_plain_outputs_match_the_constraint_and_the_reference(plain, constraint):
    params = greedy(constraint)
    outputs = plain.generate(PROMPTS[:2], params)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.token_ids == reference(plain, prompt, params)
        if constraint in ("json", "json_object") and output.finish_reason == "length":
            continue  # (the random model can spend 240 tokens on JSON's optional whitespace)
        assert output.finish_reason == "stop", (output.text, output.finish_reason)
        assert_matches(constraint, output.text)


def test_a_grammar_longer_than_max_tokens_ends_with_length(plain):
    output = plain.generate("def", greedy("json", max_tokens=5))[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 5


def test_ignore_eos_ends_where_the_grammar_is_complete(plain):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                            structured_outputs=CONSTRAINTS["choice"])
    output = plain.generate("def", params)[0]
    assert output.finish_reason == "stop" and output.text in CONSTRAINTS["choice"].choice


def test_free_and_constrained_requests_share_a_batch(plain):
    free = SamplingParams(temperature=0, max_tokens=24)
    expected_free = [o.token_ids for o in plain.generate(PROMPTS, free)]
    ids = [plain.add_request(p, greedy("compact json") if i % 2 else free) for i, p in enumerate(PROMPTS)]
    outputs = {}
    while plain.has_unfinished_requests():
        for output in plain.step():
            if output.finished:
                outputs[output.request_id] = output
    for i, request_id in enumerate(ids):
        if i % 2:
            assert_matches("compact json", outputs[request_id].text)
        else:
            assert outputs[request_id].token_ids == expected_free[i]


def test_masks_are_computed_while_the_target_pass_runs(plain, monkeypatch):
    """A step's masks and its target pass meet at a barrier: computed before the pass (or after it),
    the masks would wait there for a pass that never comes, and the barrier breaks."""
    import threading

    import draftwise.engine.constrained as constrained

    meeting, pending, meetings = threading.Barrier(2, timeout=30), [], [0]
    runner, submit, fill = plain.engine.runner, constrained._MASK_THREAD.submit, constrained.fill_masks
    forward = runner.forward

    def submitting(*args):  # (on the engine's thread, before the pass)
        pending.append(True)
        return submit(*args)

    def forward_meeting(*args, **kwargs):
        if pending:
            pending.pop()
            meeting.wait()
        return forward(*args, **kwargs)

    def fill_meeting(*args):
        meeting.wait()  # (raises BrokenBarrierError where the pass never comes)
        meetings[0] += 1
        return fill(*args)

    monkeypatch.setattr(constrained._MASK_THREAD, "submit", submitting)
    monkeypatch.setattr(runner, "forward", forward_meeting)
    monkeypatch.setattr(constrained, "fill_masks", fill_meeting)
    outputs = plain.generate(PROMPTS[:2], greedy("regex"))
    for output in outputs:
        assert_matches("regex", output.text)
    assert meetings[0] >= len(outputs[0].token_ids) and not pending


# --- speculation under a grammar ----------------------------------------------------------------


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_speculative_constrained_output_equals_plain(name, adaptive, tiny_qwen, random_draft, plain, drafting_pays):
    llm = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False,
              speculative={**DRAFTERS[name](tiny_qwen, random_draft), "adaptive": adaptive})
    for constraint in ("json", "regex", "grammar"):
        params = greedy(constraint)
        expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
        solo = [llm.generate(p, params)[0] for p in PROMPTS]
        batched = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in solo] == expected, constraint
        assert [o.token_ids for o in batched] == expected, constraint
        assert_drafted(solo + batched, accepted=True)  # (forced tokens are drafted by every drafter)


ENDING = {"one choice": StructuredOutputsParams(choice=["zz"]), "a*": StructuredOutputsParams(regex="a*"),
          "prefixes": StructuredOutputsParams(choice=["a", "ab", "abc"])}


@pytest.mark.parametrize("name", ["draft=target", "suffix", "layer_skip"])
def test_under_ignore_eos_a_draft_past_the_grammars_end_is_not_committed(name, tiny_qwen, random_draft, plain,
                                                                          drafting_pays):
    """A drafted end token that completes the grammar, then more (the bonus token after it): plain
    decoding stops at the end token even under ignore_eos, and so must a verified draft (before,
    the token after it was committed too and the request failed, or ended on a second end token)."""
    llm = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False,
              speculative={**DRAFTERS[name](tiny_qwen, random_draft), "adaptive": False})
    for constraint in ENDING.values():
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, structured_outputs=constraint)
        expected = [(o.token_ids, o.finish_reason) for o in plain.generate(PROMPTS, params)]
        assert all(reason == "stop" for _, reason in expected)
        assert [(o.token_ids, o.finish_reason) for o in llm.generate(PROMPTS, params)] == expected
        assert [(o.token_ids, o.finish_reason) for p in PROMPTS for o in llm.generate(p, params)] == expected


@pytest.mark.parametrize("fields, kept, message", [
    (dict(bad_words=["z"]), 0, "no token is allowed at output position 0"),  # (its one choice is banned)
    (dict(min_tokens=5), 2, "no token is allowed at output position 2"),  # (complete, but may not end yet)
])
def test_a_constraint_the_request_itself_excludes_ends_in_an_error(plain, fields, kept, message):
    """Before, the argmax over nothing (token 0, an end token here) was emitted and the request
    reported as complete: an answer outside its constraint, or shorter than min_tokens."""
    output = plain.generate("hi", SamplingParams(temperature=0, max_tokens=10, structured_outputs=ENDING["one choice"],
                                                 **fields))[0]
    assert output.finish_reason == "error" and output.error_reason == "constraint_unsatisfiable"
    assert message in output.error and len(output.token_ids) == kept


def test_a_grammar_that_matches_nothing_is_refused_and_a_dead_end_is_an_error(plain):
    with pytest.raises(InvalidParameterError, match="matches no text at all"):
        plain.generate("hi", SamplingParams(max_tokens=4, structured_outputs={"regex": r"[^\s\S]"}))
    dead_end = StructuredOutputsParams(grammar='start: "zz" B\nB: /[^\\s\\S]/\n')  # ("zz", then nothing)
    output = plain.generate("hi", SamplingParams(temperature=0, max_tokens=10, structured_outputs=dead_end))[0]
    assert output.finish_reason == "error" and "cannot be completed after output position 2" in output.error
    assert plain.tokenizer.decode(output.token_ids) == "zz"
    with pytest.raises(InvalidParameterError, match="json is false"):
        StructuredOutputsParams(json=False)


def test_forced_tokens_are_drafted_and_accepted(tiny_qwen, plain, drafting_pays):
    """Prompt lookup that needs a match of 12 tokens finds none here; every draft is what the schema
    forces (its keys, the rest of an enum value), spelled as the tokenizer spells it. The grammar
    allows other spellings of the same text, which a random target may prefer, so not every forced
    token need be accepted; forced runs are long, and the canonical spelling is taken often."""
    llm = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False,
              speculative={"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 12,
                           "prompt_lookup_max": 12})
    params = greedy("compact json", max_tokens=60)
    outputs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(PROMPTS, params)]
    totals = spec_totals(outputs)
    assert totals.num_accepted_tokens > 0 and totals.num_draft_tokens > 1.5 * totals.num_drafts, totals.summary()


def test_drafts_are_cut_where_they_leave_the_grammar_before_the_pass(tiny_qwen, plain, drafting_pays, monkeypatch):
    """Prompt lookup copies the prompt, which the regex mostly refuses: each draft is cut at its
    first refused token, and what the target's pass is fed is all inside the grammar (greedy rows
    keep nothing refused: it could never equal the masked target's token)."""
    import draftwise.engine.engine as engine_module

    cut, fed = [], []
    cut_draft, pending_masks = engine_module.within_grammar, engine_module.PendingMasks

    def cutting(seq, draft, limit):
        kept = cut_draft(seq, draft, limit)
        cut.append(len(draft.first_children().token_ids[:limit]) - len(kept.token_ids))
        return kept

    def feeding(batch, drafts, vocab_size):  # built just before the pass, from the drafts it is fed
        for seq, draft in zip(batch, drafts):
            if seq.grammar is not None and draft.token_ids:
                fed.append(seq.grammar.valid_prefix(draft.token_ids) == len(draft.token_ids))
        return pending_masks(batch, drafts, vocab_size)

    monkeypatch.setattr(engine_module, "within_grammar", cutting)
    monkeypatch.setattr(engine_module, "PendingMasks", feeding)
    llm = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False,
              speculative={"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1,
                           "adaptive": False, "forced_drafts": False})
    prompts = ["def add(a, b): return a + b\ndef add(a, b): return a + b\ndef"] * 2
    params = greedy("regex")
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain.generate(prompts, params)]
    assert any(n > 0 for n in cut) and fed and all(fed), (cut, fed)


def test_free_rows_beside_constrained_ones_are_unchanged(tiny_qwen, random_draft, plain, drafting_pays):
    llm = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False,
              speculative=DRAFTERS["draft=target"](tiny_qwen, random_draft))
    free = SamplingParams(temperature=0, max_tokens=24)
    expected = [o.token_ids for o in plain.generate(PROMPTS, free)]
    ids = [llm.add_request(p, free) for p in PROMPTS] + [llm.add_request(p, greedy("compact json")) for p in PROMPTS]
    outputs = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                outputs[output.request_id] = output
    assert [outputs[i].token_ids for i in ids[:4]] == expected
    for i in ids[4:]:
        assert_matches("compact json", outputs[i].text)


def test_seeded_sampling_under_a_grammar_equals_plain(tiny_qwen, plain, drafting_pays):
    """A seeded row's tokens are a function of its seed and position: the same with any drafter."""
    llm = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False,
              speculative={"method": "draft", "model": str(tiny_qwen), "num_speculative_tokens": 4})
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=120,
                            structured_outputs=CONSTRAINTS["grammar"])
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    outputs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == expected
    assert_drafted(outputs, accepted=True)
    for output in outputs:
        assert_matches("grammar", output.text)


def test_the_target_drafting_for_itself_inside_a_grammar_accepts_everything(tiny_qwen, plain):
    """The draft model drafts inside the grammar (its logits masked as the target's are); without
    forced drafts (a forced token is the tokenizer's spelling, which the target may not choose) the
    target drafting for itself proposes exactly what the constrained target emits."""
    llm = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False,
              speculative={"method": "draft", "model": str(tiny_qwen), "num_speculative_tokens": 4,
                           "adaptive": False, "forced_drafts": False})
    for constraint in ("compact json", "regex", "grammar"):
        params = greedy(constraint)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [o.token_ids for o in plain.generate(
            PROMPTS, params)]
    assert llm.spec_metrics.acceptance_rate == 1.0 and llm.spec_metrics.num_draft_tokens > 20
