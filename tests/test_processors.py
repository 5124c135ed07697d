"""Logits processors (penalties, logit_bias, min_p, min_tokens, bad_words) under speculation: each
verified position processed with the history plain decoding has there. Checked against a naive
reference written here (one position at a time, from scratch), through the engine greedy (every
drafter, alone and batched, each processor shown to change the output) and sampled (Monte-Carlo
against the processed target, `test_speculative_sampling`'s chi-square)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from draftwise import LLM, SamplingParams
from draftwise.errors import InvalidParameterError
from draftwise.sampling.processors import RowHistory, bad_word_ids, process_positions
from draftwise.sampling.sampler import SamplingBatch, sampling_probs
from tests.drafting import DRAFTERS as DRAFTERS_ALL, assert_drafted
from tests.marginals import chain_rule_marginals, sampled_positions_that_fail
from tests.test_speculative_sampling import close_draft, one_thread  # noqa: F401 (fixtures)

PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):\n    print(", "import numpy as np\n",
           "x = np.zeros((3, 4))\nx = np.zeros((3, 4))\nx = np.zeros((3, 4))\nx = np."]  # (prompt lookup drafts here)


def naive(logits: torch.Tensor, params: SamplingParams, prompt: list[int], history: list[int],
          end_ids: set[int], bad_words: list[list[int]]) -> torch.Tensor:
    """One position, from scratch, in vLLM's order: allowed tokens, bans, bias, repetition,
    frequency/presence."""
    out = logits.clone().float()
    if params.allowed_token_ids:
        for t in range(len(out)):
            if t not in params.allowed_token_ids:
                out[t] = float("-inf")
    if len(history) < params.min_tokens:
        for t in end_ids:
            out[t] = float("-inf")
    for word in bad_words:
        if len(word) == 1 or history[len(history) - len(word) + 1:] == word[:-1]:
            out[word[-1]] = float("-inf")
    for token, value in (params.logit_bias or {}).items():
        out[token] += value
    for token in set(prompt + history):
        if params.repetition_penalty != 1.0:
            out[token] = out[token] / params.repetition_penalty if out[token] > 0 else out[token] * params.repetition_penalty
    for token, count in Counter(history).items():
        out[token] -= params.frequency_penalty * count + params.presence_penalty
    return out


EVERYTHING = SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3,
                            logit_bias={3: 2.5, 7: -4.0}, min_tokens=6, max_tokens=20,
                            allowed_token_ids=[0, 1, 3, 5, 7, 9, 11, 13] + list(range(16, 40, 3)))


def test_every_position_is_processed_as_plain_decoding_would_process_it():
    generator = torch.Generator().manual_seed(0)
    vocab, width = 40, 6
    for trial in range(20):
        prompt = torch.randint(vocab, (8,), generator=generator).tolist()
        output = torch.randint(vocab, (trial % 7,), generator=generator).tolist()
        draft = torch.randint(vocab, (width - 1,), generator=generator).tolist()
        bad = [[5], [9, 11], [output[-1] if output else 2, 13]]
        logits = torch.randn(1, width, vocab, generator=generator) * 3
        history = RowHistory(EVERYTHING, prompt, output, frozenset({0, 1}), bad)
        got = process_positions(logits, [history], [draft])[0]
        for i in range(width):
            expected = naive(logits[0, i], EVERYTHING, prompt, output + draft[:i], {0, 1}, bad)
            assert torch.allclose(got[i], expected, atol=1e-6), (trial, i)


@pytest.mark.parametrize("fields, message", [
    ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 10]"),
    ({"min_p": 1.5}, "min_p must be in [0, 1]"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be an integer from 0 to max_tokens"),
    ({"logit_bias": {"x": 1}}, "logit_bias must map token ids"),
    ({"logit_bias": {5: 101}}, "in [-100, 100]"),
    ({"bad_words": "word"}, "bad_words must be a list"),
    ({"logprobs": -2}, "logprobs must be an integer >= 0, or -1 for the whole vocabulary"),
    ({"prompt_logprobs": 2.0}, "prompt_logprobs must be an integer >= 0, or -1"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list of token ids"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids must be a non-empty list"),
    ({"allowed_token_ids": 7}, "allowed_token_ids must be a non-empty list"),
])
def test_bad_processor_parameters_are_refused_by_name(fields, message):
    with pytest.raises(InvalidParameterError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**fields)


def test_logit_bias_takes_openai_string_keys():
    assert SamplingParams(logit_bias={"12": -100}).logit_bias == {12: -100.0}


# --- through the engine, greedy -------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain(tiny_qwen):
    return LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False)


PROCESSORS = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=1.0),
    "repetition": dict(repetition_penalty=1.8),
    "logit_bias": dict(logit_bias={40: 6.0, 41: 6.0, 42: -100.0}),
    "min_p": dict(min_p=0.2, temperature=0.8, seed=3),  # (greedy ignores min_p: a seeded draw does not)
    "min_tokens": dict(min_tokens=12, logit_bias={2: 8.0}),  # EOS (id 2) made likely, held back 12 tokens
    "bad_words": dict(bad_words=["ab", "the", "x = np"]),
    "allowed": dict(allowed_token_ids=[2, 14, 31, 37, 40, 41, 69, 70, 71, 72, 83, 84, 99] + list(range(260, 320))),
    "all": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={40: 3.0},
                min_tokens=4, bad_words=["quick"]),
}
DRAFTERS = {name: DRAFTERS_ALL[name] for name in ("draft=target", "random draft", "draft=target tree", "ngram")}


def sampling(name: str) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 24, **PROCESSORS[name]})


def test_each_processor_changes_plain_output(plain):
    """(So that the equality below is a comparison of processed outputs.)"""
    free = [o.token_ids for o in plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))]
    for name in PROCESSORS:
        params = sampling(name)
        if name == "min_p":
            free_seeded = [o.token_ids for o in plain.generate(PROMPTS, SamplingParams(temperature=0.8, seed=3,
                                                                                       max_tokens=24))]
            assert [o.token_ids for o in plain.generate(PROMPTS, params)] != free_seeded
            continue
        assert [o.token_ids for o in plain.generate(PROMPTS, params)] != free, name


def test_processors_do_what_they_say(plain):
    tokenizer = plain.tokenizer
    biased = plain.generate("def", SamplingParams(temperature=0, max_tokens=8, logit_bias={40: 100}))[0]
    assert biased.token_ids == [40] * 8
    banned = plain.generate(PROMPTS, sampling("bad_words"))
    words = bad_word_ids(["ab", "the", "x = np"], lambda text: tokenizer.encode_batch([text])[0])
    for output in banned:
        for word in words:
            assert all(output.token_ids[i:i + len(word)] != word for i in range(len(output.token_ids)))
    held = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, logit_bias={2: 30.0}, min_tokens=5))
    for output in held:
        assert len(output.token_ids) == 6 and output.token_ids[-1] == 2 and output.finish_reason == "stop"
    allowed = sampling("allowed").allowed_token_ids
    for params in (sampling("allowed"), SamplingParams(temperature=1.0, seed=5, max_tokens=24, allowed_token_ids=allowed)):
        for output in plain.generate(PROMPTS, params):
            assert output.token_ids and set(output.token_ids) <= set(allowed)


def test_allowed_token_ids_are_checked_against_the_vocabulary_and_the_bans(plain):
    for params, message in ((SamplingParams(allowed_token_ids=[5, 320]), "allowed_token_ids hold an id >= the vocabulary"),
                            (SamplingParams(allowed_token_ids=[40], bad_words=["F"]), "bad_words ban every one"),
                            (SamplingParams(allowed_token_ids=[2], min_tokens=3), "min_tokens holds the end back")):
        with pytest.raises(InvalidParameterError, match=message):
            plain.generate("def", params)
    # with ignore_eos, EOS ends nothing: min_tokens holds nothing back
    assert plain.generate("def", SamplingParams(allowed_token_ids=[2], min_tokens=3, max_tokens=4,
                                                ignore_eos=True))[0].token_ids == [2] * 4


@pytest.mark.parametrize("drafter", [None, "draft=target", "ngram"])
def test_a_position_where_allowed_token_ids_and_bad_words_leave_nothing_ends_the_request_by_name(
        drafter, plain, tiny_qwen, random_draft):
    """'F' (id 40) is banned everywhere and 'GG' after a 'G' (41): from the second token on nothing is
    left, greedy or sampled, drafting or not."""
    llm = plain if drafter is None else LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False,
                                            speculative=DRAFTERS[drafter](tiny_qwen, random_draft))
    for sampled in ({"temperature": 0}, {"temperature": 0.8, "seed": 4}):
        params = SamplingParams(max_tokens=8, allowed_token_ids=[40, 41], bad_words=["F", "GG"], **sampled)
        outputs = llm.generate(["def", "The quick brown fox", "GG GG GG GG"], params)
        for output in outputs:
            assert output.token_ids == [41] and output.finish_reason == "error"
            assert "no token is allowed at output position 1" in output.error
    assert llm.generate("def", SamplingParams(temperature=0, max_tokens=3))[0].finish_reason == "length"


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_speculative_processed_output_equals_plain(drafter, tiny_qwen, random_draft, plain, drafting_pays):
    llm = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False,
              speculative=DRAFTERS[drafter](tiny_qwen, random_draft))
    for name in PROCESSORS:
        params = sampling(name)
        expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
        solo = [llm.generate(p, params)[0] for p in PROMPTS]
        batched = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in solo] == expected, name
        assert [o.token_ids for o in batched] == expected, name
        if (drafter, name) != ("ngram", "repetition"):  # (a repetition penalty of 1.8 leaves nothing to look up)
            assert_drafted(solo + batched, accepted=drafter.startswith("draft=target"))


# --- through the engine, sampled ------------------------------------------------------------------
REQUESTS_PER_SETTING = 1000
NUM_POSITIONS = 4
PROMPT = "The quick brown fox"
SETTINGS = [SamplingParams(temperature=0.9, min_p=0.05, presence_penalty=1.2, frequency_penalty=0.6,
                           repetition_penalty=1.4, logit_bias={40: 2.0, 41: 1.0}, max_tokens=NUM_POSITIONS,
                           ignore_eos=True, allowed_token_ids=[40, 41] + list(range(3, 320, 2))),
            SamplingParams(temperature=1.2, top_k=12, repetition_penalty=0.7, bad_words=["fox", "the"],
                           min_tokens=NUM_POSITIONS, max_tokens=NUM_POSITIONS)]


def processed_marginals(llm: LLM, params: SamplingParams) -> list[dict[int, float]]:
    """P(token at position j) under the processors, by the chain rule (the naive reference)."""
    tokenizer = llm.tokenizer
    prompt = tokenizer.encode(PROMPT)
    bad = bad_word_ids(params.bad_words or [], lambda text: tokenizer.encode_batch([text])[0])
    end_ids = set(tokenizer.eos_token_ids) if not params.ignore_eos else set()

    def processed(logits: torch.Tensor, keys: list) -> torch.Tensor:
        logits = torch.stack([naive(row, params, prompt, list(key), end_ids, bad) for row, key in zip(logits, keys)])
        batch = SamplingBatch.build([params] * len(keys), [None] * len(keys), logits.shape[-1], logits.device)
        return sampling_probs(logits, batch)

    return chain_rule_marginals(llm, prompt, NUM_POSITIONS, processed)


def test_speculative_sampling_with_processors_follows_the_processed_target(tiny_qwen, close_draft):
    llm = LLM(str(tiny_qwen), max_model_len=64, max_num_seqs=16, progress=False,
              speculative={"method": "draft", "model": str(close_draft), "num_speculative_tokens": 3,
                           "adaptive": False})
    assert not sampled_positions_that_fail(llm, PROMPT, SETTINGS, REQUESTS_PER_SETTING, NUM_POSITIONS,
                                           processed_marginals, acceptance=(0.05, 0.95))


def test_the_target_drafting_for_itself_under_processors_accepts_everything(tiny_qwen, plain):
    """The draft model applies the same processors as it drafts, with its draft in the history: the
    target drafting for itself proposes exactly what the processed target emits."""
    llm = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False,
              speculative={"method": "draft", "model": str(tiny_qwen), "num_speculative_tokens": 4,
                           "adaptive": False})
    params = sampling("all")
    outputs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert llm.spec_metrics.acceptance_rate == 1.0 and llm.spec_metrics.num_draft_tokens > 20
