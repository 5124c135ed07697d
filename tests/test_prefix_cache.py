"""Automatic prefix caching: full blocks of committed tokens shared by the requests that start with
them, counted, evicted least recently released first; and outputs bit-identical to the same requests
with caching off, greedy, seeded, speculating, under memory pressure and preemption."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from draftwise import LLM, SamplingParams
from draftwise.cache.block_manager import BlockManager, prefix_salt
from draftwise.errors import InvalidParameterError
from draftwise.runner.model_runner import ModelRunner
from tests.drafting import spec_totals

SYSTEM = "You are a careful assistant. " * 12  # a long shared beginning (many blocks of 16 tokens)
QUESTIONS = ["def add(a, b):", "The quick brown fox", "for i in range(10):", "import numpy as np"]


def test_shared_blocks_are_counted_and_evicted_least_recently_released_first():
    blocks = BlockManager(num_blocks=6, block_size=4, prefix_caching=True)
    tokens = list(range(13))  # 3 full blocks and one token
    blocks.add(0)
    blocks.grow(0, 13)
    blocks.set_length(0, 12)
    blocks.register(0, tokens)
    blocks.add(1)
    assert blocks.share_prefix(1, tokens) == 12 and blocks.tables[1] == blocks.tables[0][:3]
    assert [blocks.refs[b] for b in blocks.tables[0]] == [2, 2, 2, 1]
    assert blocks.share_prefix(1, tokens) == 0  # (only an empty sequence starts from the cache)
    blocks.check_invariants()
    blocks.free(0)
    blocks.free(1)
    assert blocks.num_free_blocks == 6 and len(blocks._cached) == 3  # the prefix kept while free
    blocks.add(2)
    assert blocks.share_prefix(2, tokens[:9]) == 8  # (all but the last token: a block and a half here)
    blocks.grow(2, 4 * 6)  # the three free blocks, then the cached one evicted
    blocks.check_invariants()
    assert len(blocks._cached) == 0 and blocks.prefix_hits == 12 + 8
    with pytest.raises(ValueError, match="cannot cut into its registered block"):
        blocks.set_length(2, 8)
        blocks.register(2, tokens)
        blocks.truncate(2, 6)


def test_a_reset_prefix_cache_finds_nothing_and_frees_its_idle_blocks():
    blocks = BlockManager(num_blocks=8, block_size=4, prefix_caching=True)
    tokens = list(range(13))
    for handle in (0, 1):  # 0 finishes (its blocks idle, cached); 1 is still running
        blocks.add(handle)
        blocks.grow(handle, 13)
        blocks.set_length(handle, 12)
        blocks.register(handle, tokens if handle == 0 else [t + 100 for t in tokens])
    blocks.free(0)
    assert len(blocks._cached) == 3
    blocks.reset_prefix_cache()
    blocks.check_invariants()
    assert len(blocks._cached) == 0 and blocks.num_free_blocks == 4
    blocks.add(2)
    assert blocks.share_prefix(2, tokens) == 0
    assert blocks.share_prefix(2, [t + 100 for t in tokens]) == 0  # (a running sequence's blocks too)
    blocks.free(1)
    blocks.check_invariants()
    assert blocks.num_free_blocks == 8 and len(blocks._cached) == 0
    blocks.grow(2, 13)  # registering and finding work again after a reset
    blocks.set_length(2, 12)
    blocks.register(2, tokens)
    blocks.add(3)
    assert blocks.share_prefix(3, tokens) == 12
    blocks.check_invariants()


def test_sequences_with_different_salts_never_share_a_block():
    """A chain's root is its salt: the same tokens under another salt find nothing; under the same
    salt they do; and a salted sequence cut back to nothing registers under its salt again."""
    blocks = BlockManager(num_blocks=16, block_size=4, prefix_caching=True)
    tokens = list(range(13))
    alpha, beta = prefix_salt("alpha", None), prefix_salt("beta", None)
    assert prefix_salt(None, None) == b"" and len({alpha, beta, prefix_salt(None, "alpha"),
                                                   prefix_salt("alpha", "x"), prefix_salt("alpha", "y")}) == 5
    blocks.add(0)
    blocks.grow(0, 13)
    blocks.set_length(0, 12)
    blocks.register(0, tokens, alpha)
    for handle, salt, found in ((1, b"", 0), (2, beta, 0), (3, alpha, 12)):
        blocks.add(handle)
        assert blocks.share_prefix(handle, tokens, salt) == found
        assert blocks.cached_prefix_length(blocks.prefix_digests(tokens, salt)) == found
    blocks.free(0)
    blocks.free(3)
    blocks.add(4)
    blocks.grow(4, 13)
    blocks.set_length(4, 12)
    blocks.register(4, [t + 100 for t in tokens], beta)
    blocks.truncate(4, 0)  # (a restart from nothing: its registered blocks stay registered, cached)
    blocks.grow(4, 13)
    blocks.set_length(4, 12)
    blocks.register(4, [t + 200 for t in tokens], beta)
    blocks.add(5)
    assert blocks.share_prefix(5, [t + 200 for t in tokens], b"") == 0
    blocks.add(6)
    assert blocks.share_prefix(6, [t + 200 for t in tokens], beta) == 12
    blocks.check_invariants()


def test_tenants_and_cache_salts_partition_the_prefix_cache(tiny_qwen):
    """Requests of different tenants, or with different cache_salt, never start from each other's
    blocks (time to first token tells nothing across them); the same tenant and salt do; outputs
    are the same either way."""
    llm = LLM(str(tiny_qwen), max_model_len=512, max_num_seqs=2, progress=False)
    prompt, params = SYSTEM[:90] + QUESTIONS[0], SamplingParams(temperature=0, max_tokens=4)
    ids = llm.tokenizer.encode(prompt)
    assert 5 * llm.runner.blocks.blocks_for(len(ids) + 4) <= llm.runner.blocks.num_blocks  # (no eviction here)

    def hits_of(prompt, **options) -> int:
        before = llm.engine_stats()["prefix_cache_hits"]
        request_id = llm.add_request(prompt, params, **options)
        outputs = []
        while llm.has_unfinished_requests():
            outputs += [o for o in llm.step() if o.request_id == request_id and o.finished]
        assert outputs[0].token_ids == expected
        hits = llm.engine_stats()["prefix_cache_hits"] - before
        assert outputs[0].num_cached_tokens == hits  # (vLLM's per-request count)
        return hits

    first = llm.generate(prompt, params)[0]  # (cached under no tenant, no salt)
    expected = first.token_ids
    assert first.num_cached_tokens == 0 and first.outputs[0].token_ids == expected
    assert hits_of(prompt, tenant="alpha") == 0
    assert hits_of(prompt, tenant="beta") == 0
    assert hits_of(prompt, tenant="alpha") > 0
    assert hits_of({"prompt": prompt, "cache_salt": "s1"}, tenant="alpha") == 0
    assert hits_of({"prompt_token_ids": ids, "cache_salt": "s1"}, tenant="alpha") > 0
    assert hits_of({"prompt_token_ids": ids, "cache_salt": "s1"}) == 0
    assert hits_of(prompt) > 0
    llm.runner.blocks.check_invariants()
    for bad in ({"prompt": prompt, "cache_salt": ""}, {"prompt": prompt, "cache_salt": 3}, {"cache_salt": "s1"},
                {"prompt": prompt, "salt": "s1"}):
        with pytest.raises(InvalidParameterError, match="cache_salt|prompt dict"):
            llm.add_request(bad, params)


@pytest.fixture(scope="module")
def uncached(tiny_qwen):
    """(Prompt kernels as where caching is on, their default there: caching alone differs.)"""
    return LLM(str(tiny_qwen), max_model_len=512, max_num_seqs=8, progress=False, enable_prefix_caching=False,
               prompt_kernels=False)


PARAMS = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0.8, seed=5, max_tokens=24)]


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3},
                                         {"method": "draft", "num_speculative_tokens": 3}])
def test_cached_prefixes_change_no_output(tiny_qwen, uncached, speculative, drafting_pays):
    if speculative is not None and speculative["method"] == "draft":
        speculative = {**speculative, "model": str(tiny_qwen)}
    llm = LLM(str(tiny_qwen), max_model_len=512, max_num_seqs=8, progress=False, speculative=speculative)
    prompts = [SYSTEM + q for q in QUESTIONS]
    for params in PARAMS:
        expected = [o.token_ids for o in uncached.generate(prompts, params)]
        first = [llm.generate(p, params)[0] for p in prompts]  # one by one: each finds the ones before
        again = llm.generate(prompts, params)  # batched, all cached
        assert [o.token_ids for o in first] == expected and [o.token_ids for o in again] == expected
    stats = llm.engine_stats()
    assert stats["prefix_cache_hits"] > 0.6 * stats["prefix_cache_queries"]
    llm.runner.blocks.check_invariants()


def test_eviction_and_preemption_with_a_small_cache(tiny_qwen, uncached):
    """A cache of 40 blocks for 8 requests of ~140 tokens: cached prefixes are evicted, requests are
    preempted and resumed (from the cache where it still holds them), and nothing changes."""
    llm = LLM(str(tiny_qwen), max_model_len=512, max_num_seqs=8, progress=False,
              kv_cache_memory_bytes=40 * 16 * ModelRunner.kv_bytes_per_token(uncached.model))
    prompts = [SYSTEM + q for q in QUESTIONS] * 2
    params = SamplingParams(temperature=0, max_tokens=40)
    expected = [o.token_ids for o in uncached.generate(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert [o.token_ids for o in llm.generate(prompts[::-1], params)] == expected[::-1]
    llm.runner.blocks.check_invariants()
    assert llm.engine_stats()["prefix_cache_hits"] > 0


def test_after_reset_prefix_cache_a_prompt_served_before_is_prefilled_again(tiny_qwen):
    llm = LLM(str(tiny_qwen), max_model_len=512, max_num_seqs=2, progress=False)
    prompt, params = SYSTEM + QUESTIONS[0], SamplingParams(temperature=0, max_tokens=4)
    first = llm.generate(prompt, params)[0].token_ids
    hits = llm.engine_stats()["prefix_cache_hits"]
    assert llm.generate(prompt, params)[0].token_ids == first
    assert llm.engine_stats()["prefix_cache_hits"] > hits
    llm.reset_prefix_cache()
    hits = llm.engine_stats()["prefix_cache_hits"]
    assert llm.generate(prompt, params)[0].token_ids == first
    assert llm.engine_stats()["prefix_cache_hits"] == hits
    llm.runner.blocks.check_invariants()


def test_a_draft_model_caches_prompts_too(tiny_qwen, drafting_pays):
    check_draft_model_prefix_cache(tiny_qwen, prompt_kernels=False)  # (with prompt kernels: test_prompt_kernels.py)


def check_draft_model_prefix_cache(model, prompt_kernels: bool) -> None:
    """The draft model (here the target itself, so every drafted token is accepted only if its cached
    blocks hold what it would compute) starts a request with the blocks of its prompt an earlier one
    absorbed; its catch-up, as the controller prices it, is the rest; a reset forgets them. (Its
    prompt goes in a prompt pass of its own with prompt kernels, in its drafting passes without.)"""
    uncached = LLM(str(model), max_model_len=512, max_num_seqs=8, progress=False, enable_prefix_caching=False,
                   prompt_kernels=prompt_kernels)
    llm = LLM(str(model), max_model_len=512, max_num_seqs=8, progress=False, prompt_kernels=prompt_kernels,
              speculative={"method": "draft", "model": str(model), "num_speculative_tokens": 3,
                           "draft_context_window": 0})
    assert llm.runner.prompt_kernels == prompt_kernels
    proposer = llm.engine.drafters["draft"].proposer
    draft_blocks = proposer.runner.blocks
    params = SamplingParams(temperature=0, max_tokens=16)
    prompts = [SYSTEM + q for q in QUESTIONS[:2]]
    expected = [o.token_ids for o in uncached.generate(prompts, params)]
    first = llm.generate(prompts[0], params)[0]
    assert draft_blocks.prefix_hits == 0
    prompt_ids = llm.tokenizer.encode(prompts[1])
    shared = draft_blocks.cached_prefix_length(draft_blocks.prefix_digests(prompt_ids))
    assert shared >= 16 * (len(llm.tokenizer.encode(SYSTEM)) // 16 - 1) > 0
    waiting = SimpleNamespace(request_id="not started", token_ids=prompt_ids + [7], output_ids=[7], prefix_salt=b"")
    assert proposer.lag(waiting) == len(prompt_ids) + 1 - shared
    second = llm.generate(prompts[1], params)[0]
    assert draft_blocks.prefix_hits == shared
    assert [first.token_ids, second.token_ids] == expected
    spec = spec_totals([first, second])
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens
    draft_blocks.check_invariants()
    llm.reset_prefix_cache()
    assert draft_blocks.cached_prefix_length(draft_blocks.prefix_digests(prompt_ids)) == 0
