"""Drafting across vocabularies (`{"method": "draft", "cross_tokenizer": true}`): the draft model's text
tokenized again in the target's; output equal to plain decoding, greedy and seeded, alone and batched;
without the flag a tokenizer mismatch stays a clear error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from draftwise import LLM, SamplingParams
from draftwise.speculative.cross_tokenizer import CrossTokenizerProposer
from draftwise.speculative.vocabulary import TokenizerMismatchError
from draftwise.text.tokenizer import Tokenizer
from tests.drafting import assert_drafted, held_rows
from tests.tiny_models import write_tiny_model

PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):\n    print(",
           "x = np.zeros((3, 4))\nx = np.zeros((3, 4))\nx = np."]


@pytest.fixture(scope="module")
def other_vocabulary(tmp_path_factory):
    """A tiny model whose tokenizer has another vocabulary (280 tokens, other merges)."""
    return write_tiny_model(tmp_path_factory.mktemp("other_vocabulary"), "llama", seed=1, vocab_size=280)


@pytest.fixture(scope="module")
def plain(tiny_qwen):
    return LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=4, progress=False)


def test_the_vocabularies_differ_and_without_the_flag_that_is_an_error(tiny_qwen, other_vocabulary):
    assert Tokenizer(tiny_qwen).id_to_token_list() != Tokenizer(other_vocabulary).id_to_token_list()
    with pytest.raises(TokenizerMismatchError, match="tokenizers differ"):
        LLM(str(tiny_qwen), progress=False, speculative={"method": "draft", "model": str(other_vocabulary)})


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=24),
                                    SamplingParams(temperature=0.8, seed=9, max_tokens=24)])
@pytest.mark.parametrize("draft", ["other", "target"])
def test_cross_tokenizer_drafts_change_no_output(tiny_qwen, other_vocabulary, plain, params, draft, drafting_pays):
    model = other_vocabulary if draft == "other" else tiny_qwen
    llm = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=4, progress=False, speculative={
        "method": "draft", "model": str(model), "cross_tokenizer": True, "num_speculative_tokens": 4,
        "adaptive": False, "quantization": "none"})
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    solo = [llm.generate(p, params)[0] for p in PROMPTS]
    batched = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in solo] == expected and [o.token_ids for o in batched] == expected
    assert not held_rows(llm)  # (a row allocated at every step and dropped was a leak)
    # (acceptance is not asked of a random model: its tokens are often not the tokenizer's own spelling
    # of their text, and which are depends on the machine's arithmetic; the text bridge is tested on
    # real text below, and the real models' tier asks a real drafter to be accepted)
    assert_drafted(solo + batched, accepted=False)


@pytest.mark.parametrize("committed, drafted", [("def add(a, b):", "\n    return a + b\n"),
                                                ("for i in range(10):\n    print(", "i)\nprint(i + 1)")])
def test_drafted_text_becomes_the_target_tokens_that_spell_it(tiny_qwen, other_vocabulary, committed, drafted):
    target, draft = Tokenizer(tiny_qwen), Tokenizer(other_vocabulary)
    bridge = CrossTokenizerProposer(None, draft, target)
    context = SimpleNamespace(token_ids=target.encode(committed))
    whole = target.encode(committed + drafted)
    assert whole[:len(context.token_ids)] == context.token_ids  # (a safe boundary, so a draft is due)
    expected = whole[len(context.token_ids):-1]  # (but the last token, which more text could change)
    assert len(expected) >= 3
    assert bridge._in_target_vocabulary(context, draft.encode(drafted)) == expected
    # A draft that cuts a character in half keeps the text before it; one that would merge into the
    # committed tokens is no draft at all.
    cut = draft.encode(drafted) + draft.encode("é")[:1]
    assert draft.decode(cut).endswith("\ufffd") and bridge._in_target_vocabulary(context, cut) == expected
    assert bridge._in_target_vocabulary(SimpleNamespace(token_ids=target.encode("de")), draft.encode("f add")) == []


def test_cross_tokenizer_refuses_trees():
    from draftwise.errors import InvalidParameterError
    from draftwise.speculative.drafters.draft_model import DraftModelOptions

    with pytest.raises(InvalidParameterError, match="cross_tokenizer drafts text, not token trees"):
        DraftModelOptions(cross_tokenizer=True, draft_branches=2)


@pytest.mark.parametrize("window", [0, 128])  # 0: the whole context, as far as it fits
def test_a_text_longer_in_the_draft_vocabulary_than_the_context_is_still_answered(
        tiny_qwen, other_vocabulary, plain, window, drafting_pays):
    """The draft model's vocabulary spells this text in ~1.4x the target's tokens: its encoding
    outgrows the context (and what the draft cache holds for the row); the draft reads less of it,
    and the request is answered exactly as plain decoding answers it (it failed before)."""
    text = "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[0]\n" * 5
    assert len(Tokenizer(other_vocabulary).encode(text)) > 256 > len(Tokenizer(tiny_qwen).encode(text)) + 48
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    llm = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=4, progress=False, speculative={
        "method": "draft", "model": str(other_vocabulary), "cross_tokenizer": True, "num_speculative_tokens": 4,
        "adaptive": False, "quantization": "none", "draft_context_window": window})
    expected = plain.generate([text, text + "x"], params)
    got = llm.generate([text, text + "x"], params)
    assert [o.error for o in got] == [None, None]
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert_drafted(got, accepted=False)
