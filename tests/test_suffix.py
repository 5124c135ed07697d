"""Suffix decoding: the index's continuations and frequencies, the shared cache's bounds and
partitions, and the drafter on a model (a request seen before is drafted from the cache and every
draft is accepted; the output stays plain decoding's)."""

import random
import tracemalloc

import pytest

from draftwise import LLM, SamplingParams
from draftwise.errors import InvalidParameterError
from draftwise.speculative.drafters.suffix import BYTES_PER_TOKEN, SuffixCache, SuffixOptions
from draftwise.speculative.suffix_index import SuffixIndex
from tests.drafting import assert_drafted

ANY = dict(max_match=24, min_probability=0.0)


def test_the_most_frequent_continuation_of_the_longest_match_with_its_frequencies():
    index = SuffixIndex()
    # after (1, 2): 3 4 5 twice, 3 9 once; after (7, 1, 2) only 3 9: the longer match decides
    index.extend([1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 7, 1, 2, 3, 9, 0])
    found = index.lookup([8, 1, 2], 5, **ANY)
    assert found.token_ids[:3] == [3, 4, 5] and found.match_length == 2 and found.occurrences == 3
    assert found.probabilities[:3] == pytest.approx([1.0, 2 / 3, 2 / 3])
    longer = index.lookup([7, 1, 2], 5, **ANY)
    assert longer.token_ids[:2] == [3, 9] and longer.match_length == 3 and longer.occurrences == 1
    # the draft stops where the path's frequency falls below the threshold
    assert index.lookup([8, 1, 2], 5, max_match=24, min_probability=0.7).token_ids == [3]
    assert index.lookup([5, 6], 5, **ANY).token_ids == []  # never seen
    assert index.lookup([2], 5, **ANY).match_length == 1  # one token is a match too (a weak one)


def test_a_tree_of_the_most_frequent_continuations_best_first():
    index = SuffixIndex()
    # after (1, 2), one document each: 3 4 5 three times, 3 9 twice, 6 7 once
    for document, text in enumerate([[1, 2, 3, 4, 5]] * 3 + [[1, 2, 3, 9]] * 2 + [[1, 2, 6, 7]]):
        index.extend(text, document)
        index.separate()
    found = index.lookup([8, 1, 2], 6, max_match=24, min_probability=0.1, max_branches=2)
    # best first, by path probability: 3 (5/6), 4 and 5 under it (3/6), 9 under 3 (2/6), then 6 and 7 (1/6)
    nodes = list(zip(found.token_ids, found.parents, found.probabilities))
    assert nodes == [(3, -1, pytest.approx(5 / 6)), (4, 0, pytest.approx(3 / 6)), (5, 1, pytest.approx(3 / 6)),
                     (9, 0, pytest.approx(2 / 6)), (6, -1, pytest.approx(1 / 6)), (7, 4, pytest.approx(1 / 6))]
    assert all(parent < i for i, parent in enumerate(found.parents))
    chain = index.lookup([8, 1, 2], 6, max_match=24, min_probability=0.1)
    assert chain.token_ids == [3, 4, 5] and chain.parents == [-1, 0, 1]


def test_an_old_long_match_is_found_behind_many_newer_short_ones():
    index = SuffixIndex()
    index.extend([10, 11, 12, 13, 14, 15, 16, 17], document=0)
    index.separate()
    for document in range(1, 200):  # token 13 many times since, never after 10 11 12
        index.extend([50 + document % 7, 13, 60 + document % 5], document=document)
        index.separate()
    found = index.lookup([9, 10, 11, 12, 13], 3, **ANY)
    assert found.token_ids == [14, 15, 16] and found.match_length == 4 and found.documents == {0}


def test_the_context_itself_is_no_evidence_and_documents_do_not_run_into_each_other():
    index = SuffixIndex()
    index.extend([1, 2, 3], document=0)
    assert index.lookup([1, 2, 3], 4, **ANY).token_ids == []  # 3 only at the very end: nothing after it
    index.separate()
    index.extend([2, 3, 4, 1, 2], document=1)
    found = index.lookup([5, 1, 2], 4, **ANY)
    assert found.token_ids == [3] and found.documents == {0}  # document 0 ends after 3: no crossing into 1
    index.drop(0)
    weaker = index.lookup([5, 1, 2], 4, **ANY)  # now only the 2 that opens document 1 (a one-token match)
    assert weaker.documents == {1} and weaker.match_length == 1 and weaker.token_ids == [3, 4, 1, 2]
    before = index.lookup([9, 2, 3], 4, **ANY)
    index.compact()
    assert list(index.tokens) == [2, 3, 4, 1, 2] and index.lookup([9, 2, 3], 4, **ANY) == before


def test_the_cache_stays_in_its_bounds_evicts_the_least_recently_matched_and_keeps_tenants_apart():
    cache = SuffixCache(max_bytes=45 * BYTES_PER_TOKEN)  # 45 tokens: 30 live, the rest evicted awaiting compaction
    cache.add("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # 10 with its separator
    cache.add("a", [11, 12, 13, 14, 15, 16, 17, 18, 19])
    cache.add("b", [1, 2, 3, 40, 50])
    assert cache.lookup("a", [1, 2], 3, **ANY).token_ids == [3, 4, 5]
    assert cache.lookup("b", [1, 2], 3, **ANY).token_ids == [3, 40, 50]  # its own text only
    assert cache.lookup("c", [1, 2], 3, **ANY).token_ids == []
    cache.add("a", [21, 22, 23, 24, 25, 26, 27, 28, 29])  # over 30: the least recently matched goes
    assert cache.num_tokens <= 30
    assert cache.lookup("a", [11, 12], 3, **ANY).token_ids == []  # evicted (never matched)
    assert cache.lookup("a", [1, 2], 3, **ANY).token_ids == [3, 4, 5]  # matched recently: kept
    for start in range(100, 1000, 10):  # many more: the corpus is compacted, never grows past its bound
        cache.add("a", list(range(start, start + 9)))
        assert cache.num_tokens <= 30 and cache.corpus_tokens() <= 45  # evicted text counts until compacted
    assert cache.lookup("b", [1, 2], 3, **ANY).token_ids == []  # b's one document evicted, its corpus gone


def test_the_cache_holds_no_more_than_its_bytes():
    """suffix_cache_mb is what the cache takes: evicted text still in a corpus counts (it costs what
    live text does until compacted)."""
    budget = 2 * 2 ** 20
    rng = random.Random(0)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cache = SuffixCache(max_bytes=budget)
    most = 0
    for _ in range(120):
        cache.add(None, [rng.randrange(150_000) for _ in range(500)])
        most = max(most, tracemalloc.get_traced_memory()[0] - before)
    tracemalloc.stop()
    assert cache.corpus_tokens() * BYTES_PER_TOKEN <= budget
    assert most <= 1.1 * budget  # (between additions; a compaction briefly holds a partition twice)


def test_a_cached_token_costs_about_what_the_bound_assumes():
    cache = SuffixCache(max_bytes=10 ** 9)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for start in range(0, 200_000, 500):
        cache.add(None, [(start + i * 7919) % 150_000 for i in range(500)])
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert 0.5 * BYTES_PER_TOKEN <= used / cache.num_tokens <= BYTES_PER_TOKEN  # no token repeats: the worst case


@pytest.mark.parametrize("options, message", [
    ({"suffix_max_depth": 1}, "suffix_max_depth"), ({"suffix_min_probability": 1.5}, "suffix_min_probability"),
    ({"suffix_max_spec_factor": 0}, "suffix_max_spec_factor"), ({"suffix_cache_mb": -1}, "suffix_cache_mb"),
    ({"suffix_max_branches": 0}, "suffix_max_branches")])
def test_bad_options_are_refused_by_name(options, message):
    with pytest.raises(InvalidParameterError, match=message):
        SuffixOptions(**options)


def test_a_request_seen_before_is_drafted_from_the_cache_and_every_draft_is_accepted(tiny_qwen, drafting_pays):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompt = "Write a function that reverses a list:"
    plain = LLM(str(tiny_qwen), max_model_len=256, progress=False).generate(prompt, params)[0]
    llm = LLM(str(tiny_qwen), max_model_len=256, progress=False,
              speculative={"method": "suffix", "num_speculative_tokens": 8})
    first = llm.generate(prompt, params)[0]
    before = llm.spec_metrics.num_accepted_tokens
    again = llm.generate(prompt, params)[0]
    assert first.token_ids == again.token_ids == plain.token_ids
    assert_drafted([again])
    spec = again.metrics.spec
    assert spec.num_draft_tokens >= 16 and spec.num_accepted_tokens == spec.num_draft_tokens
    assert llm.spec_metrics.num_accepted_tokens > before
    # with the cache off the second run has only its own text
    off = LLM(str(tiny_qwen), max_model_len=256, progress=False,
              speculative={"method": "suffix", "num_speculative_tokens": 8, "suffix_cache_mb": 0})
    off.generate(prompt, params)
    assert off.generate(prompt, params)[0].metrics.spec.num_accepted_tokens < spec.num_accepted_tokens


def test_a_tree_cut_to_the_spec_factor_keeps_one_score_per_node():
    from types import SimpleNamespace

    from draftwise.sampling.params import SamplingParams
    from draftwise.speculative.drafters.suffix import SuffixProposer

    proposer = SuffixProposer(SuffixOptions(suffix_max_depth=2, suffix_cache_mb=0, suffix_min_probability=0.0))
    # (1, 2) followed by 3 4 once and 6 7 once: a tree of 4; the match is 2 long, so 2 nodes at most
    text = [5, 0, 1, 2, 3, 4, 5, 0, 1, 2, 6, 7, 5, 0, 1, 2]
    seq = SimpleNamespace(request_id="r", token_ids=text, output_ids=[], params=SamplingParams(), tenant=None)
    draft = proposer.propose([seq], [6])[0]
    assert draft.parents is not None and len(draft.token_ids) == 2
    assert len(draft.scores) == len(draft.parents) == len(draft.token_ids)


def test_forgetting_the_history_drafts_a_request_seen_before_as_a_new_one(tiny_qwen, drafting_pays):
    """`LLM.forget_drafter_history` (benchmarks call it after a warm-up and before a closed loop of
    prompts already run): the cache of earlier requests is gone, the drafter still works."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompt = "Write a function that reverses a list:"
    spec = {"method": "suffix", "num_speculative_tokens": 8}
    remembering = LLM(str(tiny_qwen), max_model_len=256, progress=False, speculative=spec)
    forgetting = LLM(str(tiny_qwen), max_model_len=256, progress=False, speculative=spec)
    for llm in (remembering, forgetting):
        llm.generate(prompt, params)
    forgetting.forget_drafter_history()
    seen, forgotten = (llm.generate(prompt, params)[0] for llm in (remembering, forgetting))
    assert seen.token_ids == forgotten.token_ids
    assert forgotten.metrics.spec.num_accepted_tokens < seen.metrics.spec.num_accepted_tokens
    again = forgetting.generate(prompt, params)[0].metrics.spec  # (learnt again from the forgotten run's text)
    assert again.num_accepted_tokens > forgotten.metrics.spec.num_accepted_tokens


def test_a_closed_loop_and_a_warm_up_leave_no_history_behind(tiny_qwen, monkeypatch):
    from types import SimpleNamespace

    from draftwise.benchmark.configs import DraftwiseConfig
    from draftwise.benchmark.probes import ClosedLoop

    forgot = []
    llm = LLM(str(tiny_qwen), max_model_len=256, progress=False, speculative={"method": "suffix"})
    monkeypatch.setattr(llm, "forget_drafter_history", lambda: forgot.append("forgot"))
    ClosedLoop(2, ("a", "b"), ("x", "x"), 2).measure(SimpleNamespace(llm=llm))
    assert forgot == ["forgot"]
    DraftwiseConfig.warm_up(SimpleNamespace(llm=llm), "a")
    assert forgot == ["forgot"] * 2


def test_a_short_match_is_found_where_the_long_key_occurs_only_at_the_end_or_in_dropped_text():
    own = SuffixIndex()  # a request's own text: its last 4 tokens occur once, at the very end
    own.extend([10, 2, 3, 9, 7, 8, 5, 2, 3])
    found = own.lookup([10, 2, 3, 9, 7, 8, 5, 2, 3], 3, **ANY)
    assert found.token_ids == [9, 7, 8] and found.match_length == 2
    shared = SuffixIndex()
    shared.extend([1, 2, 3, 4, 5], document=0)  # the long key (1, 2, 3, 4) only here, then dropped
    shared.separate()
    shared.extend([9, 3, 4, 60, 61], document=1)
    shared.drop(0)
    found = shared.lookup([1, 2, 3, 4], 2, **ANY)
    assert found.token_ids == [60, 61] and found.documents == {1}


def test_only_requests_that_ended_as_they_should_join_the_cache_and_each_once():
    from types import SimpleNamespace

    from draftwise.speculative.drafters.suffix import SuffixProposer

    proposer = SuffixProposer(SuffixOptions())

    def request(request_id, reason):
        return SimpleNamespace(request_id=request_id, finish_reason=reason, tenant=None, token_ids=[1, 2, 3, 4, 5, 6],
                               output_ids=[4, 5, 6])

    for request_id, reason in (("failed", "error"), ("aborted", "abort"), ("running", None)):
        proposer.release(request(request_id, reason))
    assert proposer.cache.num_tokens == 0
    done = request("done", "length")
    proposer.release(done)
    proposer.release(done)  # (undone in a failed step, then retired)
    assert proposer.cache.num_tokens == len(done.token_ids) + 1  # its text and a separator, once
