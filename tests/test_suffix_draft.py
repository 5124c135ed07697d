"""Suffix decoding with a draft model behind it: which of the two drafts a row, what the controller
is charged, its options, and on a model: output equal to plain decoding, the suffix tree drafting a
request seen before and the draft model a new one."""

from types import SimpleNamespace

import pytest

from draftwise import LLM, SamplingParams
from draftwise.errors import InvalidParameterError
from draftwise.speculative.config import SpeculativeConfig
from draftwise.speculative.drafters.suffix import SuffixOptions, SuffixProposer
from draftwise.speculative.drafters.suffix_draft import SuffixThenModelProposer
from draftwise.speculative.proposer import Draft, Footprint
from tests.drafting import assert_drafted

REPEATED = [5, 0, 1, 2, 3, 4, 8, 9, 5, 0, 1, 2, 3, 4, 8, 9, 5, 0, 1, 2]  # ...then 3 4 8 9, seen twice
NEW = [11, 12, 13, 14, 15, 16, 17, 18]  # nothing repeats


class CountingModel:
    """A stand-in draft model: drafts 7s, counts what it was asked, owes `backlog` tokens."""

    catch_up_window = 128

    def __init__(self, backlog: int = 40) -> None:
        self.asked: list[tuple[list[str], list[int]]] = []
        self.verified = self.released = 0
        self.backlog = backlog

    def propose(self, seqs, num_tokens):
        self.asked.append(([seq.request_id for seq in seqs], list(num_tokens)))
        return [Draft([7] * k) for k in num_tokens]

    def on_verified(self, seqs, num_accepted):
        self.verified += 1

    def release(self, seq):
        self.released += 1

    def lag(self, seq):
        return self.backlog

    def footprint(self):
        return Footprint(1000, 10)


def sequence(request_id: str, token_ids: list[int]):
    return SimpleNamespace(request_id=request_id, token_ids=token_ids, output_ids=[], tenant=None, finished=False)


def hybrid(min_expected: float = 2.0) -> tuple[SuffixThenModelProposer, CountingModel]:
    model = CountingModel()
    suffix = SuffixProposer(SuffixOptions(suffix_cache_mb=0, suffix_max_branches=1))
    return SuffixThenModelProposer(suffix, model, min_expected), model


def test_the_suffix_tree_drafts_text_seen_before_and_the_model_the_rest():
    proposer, model = hybrid()
    seen, new = sequence("seen", REPEATED), sequence("new", NEW)
    drafts = proposer.propose([seen, new, sequence("idle", NEW)], [4, 3, 0])
    assert drafts[0].token_ids == [3, 4, 8, 9]  # the suffix tree's continuation, cut to k
    assert drafts[1].token_ids == [7, 7, 7] and drafts[2].token_ids == []
    assert model.asked == [(["new"], [3])]  # only the new row, and not the row asked for nothing
    # the controller is charged the model's backlog only where the model will draft
    assert proposer.lag(seen) == 0 and proposer.lag(new) == 40
    proposer.on_verified([seen, new], [4, 0])
    proposer.release(new)
    assert model.verified == 1 and model.released == 1
    assert proposer.footprint() == Footprint(1000 + proposer.suffix.footprint().weights_bytes, 10)


def test_a_weak_suffix_match_goes_to_the_model():
    # seen twice, but asking for more evidence than the match holds hands the row to the model
    proposer, model = hybrid(min_expected=10.0)  # (it continues with the 8 tokens after the match)
    assert proposer.propose([sequence("seen", REPEATED)], [4])[0].token_ids == [7, 7, 7, 7]
    assert proposer.lag(sequence("seen", REPEATED)) == 40


@pytest.mark.parametrize("options, message", [
    ({"suffix_min_expected": 0}, "suffix_min_expected"), ({"suffix_min_expected": True}, "suffix_min_expected"),
    ({"suffix_max_depth": 1}, "suffix_max_depth"), ({"draft_branches": 9}, "draft_branches"),
    ({"suffix_max_branch": 2}, "suffix_max_branch")])
def test_bad_options_are_refused_by_name(options, message):
    with pytest.raises(InvalidParameterError, match=message):
        SpeculativeConfig.from_value({"method": "suffix_draft", **options})


def test_it_costs_what_its_draft_model_costs(tiny_qwen, monkeypatch):
    """The profile times the draft model (timing the suffix tree on the profile's repeated sample
    text would make drafting look free)."""
    from draftwise.speculative.drafters import suffix_draft

    timed = []
    monkeypatch.setattr(suffix_draft, "measure", lambda runner, proposer, tokenizer, k: timed.append(proposer))
    proposer, model = hybrid()
    suffix_draft.profile_draft_model(None, proposer, None, 4)
    assert timed == [model]


def test_output_equals_plain_and_a_request_seen_before_is_drafted_by_the_suffix_tree(tiny_qwen, drafting_pays):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["Write a function that reverses a list:", "The quick brown fox", "héllo wörld"]
    plain = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=4, progress=False, quantization="none")
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=4, progress=False, quantization="none",
              speculative={"method": "suffix_draft", "model": str(tiny_qwen), "quantization": "none",
                           "num_speculative_tokens": 4})
    model_calls = []
    inner = llm.engine.drafters["suffix_draft"].proposer.model
    propose = inner.propose
    inner.propose = lambda seqs, ks: model_calls.append(len(seqs)) or propose(seqs, ks)
    solo = [llm.generate(p, params)[0] for p in prompts]
    assert [o.token_ids for o in solo] == expected
    # new text: the draft model (here the target itself) drafted, and everything it drafted was kept
    drafted = assert_drafted(solo)
    assert model_calls and drafted.num_accepted_tokens == drafted.num_draft_tokens
    model_calls.clear()
    batched = llm.generate(prompts, params)  # seen before: the suffix tree's cache has every answer
    assert [o.token_ids for o in batched] == expected
    assert assert_drafted(batched).num_draft_tokens >= 3 * 16 and not model_calls


@pytest.mark.parametrize("eos_index, max_tokens", [(6, 24), (None, 7), (None, 2)])
def test_eos_and_max_tokens_inside_a_suffix_draft(eos_index, max_tokens, tiny_qwen, monkeypatch, drafting_pays):
    """A request seen before: the suffix tree drafts the whole cached answer, and the output still
    stops at an EOS inside the accepted draft, or at max_tokens."""
    prompt = "Write a function that reverses a list:"
    plain = LLM(str(tiny_qwen), max_model_len=256, progress=False, quantization="none")
    llm = LLM(str(tiny_qwen), max_model_len=256, progress=False, quantization="none",
              speculative={"method": "suffix_draft", "model": str(tiny_qwen), "quantization": "none",
                           "num_speculative_tokens": 8})
    full = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].token_ids
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))  # now in the cache
    if eos_index is not None:
        eos = full[eos_index]
        for target in (llm, plain):
            monkeypatch.setattr(target.tokenizer, "eos_token_ids", frozenset({eos}))
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == plain.generate(prompt, params)[0].token_ids
    if eos_index is not None:
        assert out.token_ids == full[:full.index(eos) + 1] and out.finish_reason == "stop"
    else:
        assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
    if max_tokens > 2:
        assert assert_drafted([out]).num_accepted_tokens == out.metrics.spec.num_draft_tokens
