"""What the scheduler reserves of the KV cache for a row, and what a row may use: a request is refused
only if its prompt and max_tokens could not fit the whole cache; a plain row's reservation does not
grow when another request brings a drafter; a tree's nodes stay within what its row reserved and
within the context; a cache too small to measure speculation's costs is said so."""

import pytest

from draftwise import LLM, SamplingParams
from draftwise.errors import InvalidParameterError
from draftwise.runner.model_runner import ModelRunner

PROMPT = "the quick brown fox"


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_qwen):
    return LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=4, progress=False)


@pytest.fixture(scope="module")
def bytes_per_token(plain):
    return ModelRunner.kv_bytes_per_token(plain.model)


def test_a_request_that_fills_the_context_exactly_runs(tiny_qwen, plain):
    """64 positions, 4 blocks of 16: a 4-token prompt and 60 new tokens never hold more than 63
    (before: refused, as if a draft's growth were added past the request's end)."""
    llm = LLM(str(tiny_qwen), max_model_len=64, max_num_seqs=1, progress=False)
    prompt_tokens = len(llm.tokenizer.encode(PROMPT))
    out = llm.generate(PROMPT, greedy(64 - prompt_tokens))[0]
    assert out.finish_reason == "length" and out.token_ids == plain.generate(PROMPT, greedy(64 - prompt_tokens))[0].token_ids


def test_a_plain_request_admitted_before_a_drafter_arrived_still_finishes(tiny_qwen, plain, bytes_per_token):
    """A cache of 10 blocks of 8 holds the plain request's 80 tokens; a request that then brings a
    drafter drafting 4 tokens must not make the plain row reserve 4 more (before: near its end it
    was preempted with nothing running, and every later step raised KVCacheFullError)."""
    llm = LLM(str(tiny_qwen), max_model_len=256, block_size=8, kv_cache_memory_bytes=10 * 8 * bytes_per_token,
              progress=False)
    max_tokens = 80 - 1 - len(llm.tokenizer.encode(PROMPT))
    first = llm.add_request(PROMPT, greedy(max_tokens))
    llm.add_request("x", greedy(4), speculative={"method": "ngram", "num_speculative_tokens": 4})
    finished = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished[first].finish_reason == "length"
    assert finished[first].token_ids == plain.generate(PROMPT, greedy(max_tokens))[0].token_ids
    assert llm.engine_stats()["kv_blocks_in_use"] == 0


TREE = {"method": "draft", "num_speculative_tokens": 4, "draft_branches": 4, "adaptive": False}


def test_tree_drafts_stay_within_their_rows_blocks(tiny_qwen, plain, bytes_per_token):
    """The target drafting for itself in trees of up to 4 x 4 nodes, four requests in 16 blocks of 8
    (before: a tree fed more nodes than the row reserved, and rows ended in KVCacheFullError)."""
    prompts = [PROMPT, "def add return value", "x y z for range", "print the quick"]
    llm = LLM(str(tiny_qwen), max_model_len=256, block_size=8, kv_cache_memory_bytes=16 * 8 * bytes_per_token,
              progress=False, speculative={**TREE, "model": str(tiny_qwen)})
    outs = llm.generate(prompts, greedy(40))
    assert [(o.finish_reason, o.token_ids) for o in outs] == \
        [("length", plain.generate(p, greedy(40))[0].token_ids) for p in prompts]
    assert sum(o.metrics.spec.num_draft_tokens for o in outs) > 0
    assert llm.engine_stats()["kv_blocks_in_use"] == 0


def test_tree_drafts_stay_within_the_context(tiny_qwen):
    """Near the end of a 64-position context a tree's nodes would pass it (before: the request ended
    in an error after 46 tokens where plain decoding runs to 60 and 'length')."""
    reference = LLM(str(tiny_qwen), max_model_len=64, max_num_seqs=2, progress=False).generate(PROMPT, greedy(200))[0]
    llm = LLM(str(tiny_qwen), max_model_len=64, progress=False, speculative={**TREE, "model": str(tiny_qwen)})
    out = llm.generate(PROMPT, greedy(200))[0]
    assert (out.finish_reason, out.token_ids) == ("length", reference.token_ids)


def test_a_cache_too_small_to_measure_costs_is_said_so(tiny_qwen, bytes_per_token, tmp_path, monkeypatch):
    from draftwise.speculative.control.profile import PROFILES_ENV

    monkeypatch.setenv(PROFILES_ENV, str(tmp_path))  # (nothing measured before: it must measure)
    with pytest.raises(InvalidParameterError, match="needs a context of .* tokens, and the KV cache .* holds 64"):
        LLM(str(tiny_qwen), max_model_len=256, block_size=8, kv_cache_memory_bytes=8 * 8 * bytes_per_token,
            progress=False, speculative={"method": "ngram", "num_speculative_tokens": 3})


def test_a_drafter_built_on_first_use_while_running_requests_fill_the_cache_says_so_and_harms_none(
        tiny_qwen, plain, tmp_path, monkeypatch):
    """A per-request method is built on its first request, timing this machine's costs in the target's
    cache: where running requests hold that room, the new request is refused with what to do; the
    running ones finish as plain decoding computes them."""
    from draftwise.errors import KVCacheFullError
    from draftwise.speculative.control.profile import PROFILES_ENV

    monkeypatch.setenv(PROFILES_ENV, str(tmp_path))  # (nothing measured before: it must measure)
    llm = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=2, block_size=16, progress=False,
              kv_cache_memory_bytes=32 * 16 * ModelRunner.kv_bytes_per_token(plain.model))
    prompt = "word " * 20
    running = [llm.add_request(prompt, greedy(190)) for _ in range(2)]
    for _ in range(170):
        llm.step()
    with pytest.raises(KVCacheFullError, match=r"method 'suffix' is built on first use.*prepare_drafter\('suffix'\)"):
        llm.add_request("hello", greedy(8), speculative={"method": "suffix"})
    finished = {}
    while llm.has_unfinished_requests():
        finished.update({out.request_id: out for out in llm.step() if out.finished})
    expected = plain.generate(prompt, greedy(190))[0].outputs[0].token_ids
    assert sorted(finished) == sorted(running)
    assert all(list(out.outputs[0].token_ids) == list(expected) for out in finished.values())
    assert "suffix" not in llm.engine.drafters
