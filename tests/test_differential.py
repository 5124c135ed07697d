"""Speculative decoding against plain decoding on random request mixes (a seeded differential test):
greedy outputs are equal token for token, with the same finish reason and text, whatever the
drafter, the requests' stops, stop token ids, limits, penalties, biases and constraints, batched or
arriving while others run, in a cache small enough to preempt. The examples are drawn from a fixed
seed: each run checks the same ones (a failure names its example)."""

from __future__ import annotations

import random

import pytest

from draftwise import LLM, SamplingParams
from draftwise.runner.model_runner import ModelRunner
from tests.drafting import held_rows
from tests.tiny_models import write_tiny_model

EXAMPLES = 10  # request mixes per drafter
MAX_MODEL_LEN = 256
TEXTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog. ",
         "for i in range(10):\n    print(i * i)\n", "héllo wörld, ça va? 你好 🙂"]


@pytest.fixture(scope="module")
def looping(tmp_path_factory):
    """A tiny target whose greedy text soon repeats itself: drafts get accepted, and end inside runs."""
    return write_tiny_model(tmp_path_factory.mktemp("looping"), "qwen2", seed=0, residual_scale=0.05)


@pytest.fixture(scope="module")
def plain(looping):
    return LLM(str(looping), max_model_len=MAX_MODEL_LEN, max_num_seqs=8, progress=False)


def drafters(looping, random_draft) -> dict[str, tuple[dict, int | None]]:
    """name -> (speculative config, KV blocks or None for the default cache)."""
    model = str(looping)
    return {
        "draft model (the target itself)": ({"method": "draft", "model": model, "num_speculative_tokens": 6}, None),
        "random draft model": ({"method": "draft", "model": str(random_draft), "num_speculative_tokens": 5}, None),
        "draft model tree, small cache": ({"method": "draft", "model": model, "num_speculative_tokens": 4,
                                           "draft_branches": 2}, 16),
        "suffix tree": ({"method": "suffix", "num_speculative_tokens": 8, "suffix_max_branches": 3}, None),
        "ngram": ({"method": "ngram", "num_speculative_tokens": 7}, None),
        "layer skip": ({"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 5}, None),
    }


def random_prompt(draw: random.Random, earlier: list[str]) -> str:
    kind = draw.choice(["text", "repeated", "earlier", "short"])
    if kind == "text":
        text = draw.choice(TEXTS)
        return text[:draw.randint(1, len(text))]
    if kind == "repeated":
        piece = draw.choice(TEXTS)[:draw.randint(3, 20)]
        return piece * draw.randint(2, 5)
    if kind == "earlier" and earlier:  # (an earlier answer again: suffix decoding's cache drafts it)
        return draw.choice(earlier)[-120:] or "a"
    return draw.choice(["a", "\n", "def", "x = "])


def random_params(draw: random.Random, greedy_text: str, greedy_ids: list[int], eos: int | None) -> dict:
    """Greedy parameters whose stops and biases land inside what plain decoding writes."""
    fields: dict = {"temperature": 0.0, "max_tokens": draw.randint(1, 40)}
    if draw.random() < 0.3:
        fields["ignore_eos"] = True
    if draw.random() < 0.25:
        fields["min_tokens"] = draw.randint(0, min(fields["max_tokens"], 10))
    if draw.random() < 0.4 and len(greedy_text) > 2:
        start = draw.randrange(len(greedy_text) - 1)
        fields["stop"] = [greedy_text[start:start + draw.randint(1, 5)]]
        fields["include_stop_str_in_output"] = draw.random() < 0.5
    if draw.random() < 0.3 and greedy_ids:
        fields["stop_token_ids"] = [draw.choice(greedy_ids)]
    if draw.random() < 0.3:
        fields["repetition_penalty"] = draw.choice([0.8, 1.3, 2.0])
    if draw.random() < 0.2:
        fields["presence_penalty"] = draw.choice([-1.0, 1.5])
        fields["frequency_penalty"] = draw.choice([-0.5, 1.2])
    if draw.random() < 0.3 and greedy_ids:
        fields["logit_bias"] = {draw.choice(greedy_ids): draw.choice([-100.0, 5.0])}
        if eos is not None and draw.random() < 0.5:  # (an end token inside accepted drafts)
            fields["logit_bias"][eos] = draw.choice([4.0, 10.0])
    if draw.random() < 0.15:
        fields["structured_outputs"] = draw.choice([{"regex": r"[a-z ]{1,30}"}, {"regex": r"[0-9]+(, [0-9]+){0,5}"},
                                                    {"choice": ["yes", "no", "quick brown"]}])
    return fields


def run_arriving(llm: LLM, prompts: list[str], params: list[SamplingParams], arrivals: list[int]) -> list:
    """Requests added at their arrival step while the others run; their final outputs in order."""
    ids, finished, step = {}, {}, 0
    while len(ids) < len(prompts) or llm.has_unfinished_requests():
        for index in range(len(prompts)):
            if arrivals[index] == step:
                ids[llm.add_request(prompts[index], params[index])] = index
        finished.update({ids[o.request_id]: o for o in llm.step() if o.finished} if llm.has_unfinished_requests()
                        else {})
        step += 1
        assert step < 5000, "the engine stopped making progress"
    return [finished[index] for index in range(len(prompts))]


@pytest.mark.parametrize("name", ["draft model (the target itself)", "random draft model",
                                  "draft model tree, small cache", "suffix tree", "ngram", "layer skip"])
def test_speculation_equals_plain_decoding_on_random_request_mixes(name, looping, random_draft, plain):
    speculative, blocks = drafters(looping, random_draft)[name]
    memory = None if blocks is None else blocks * 16 * ModelRunner.kv_bytes_per_token(plain.model)
    llm = LLM(str(looping), max_model_len=MAX_MODEL_LEN, max_num_seqs=8, progress=False,
              speculative={**speculative, "adaptive": False}, kv_cache_memory_bytes=memory)
    eos = min(plain.tokenizer.eos_token_ids) if plain.tokenizer.eos_token_ids else None
    draw, earlier, drafted = random.Random(f"differential {name}"), [], 0
    for example in range(EXAMPLES):
        count = draw.randint(1, 6)
        prompts = [random_prompt(draw, earlier) for _ in range(count)]
        if blocks is not None:
            prompts = [prompt[-60:] for prompt in prompts]
        greedy = plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        params = [SamplingParams(**random_params(draw, g.text, g.token_ids, eos)) for g in greedy]
        expected = plain.generate(prompts, params)
        arrivals = [0 if draw.random() < 0.5 else draw.randint(0, 12) for _ in prompts]
        got = llm.generate(prompts, params) if draw.random() < 0.5 else run_arriving(llm, prompts, params, arrivals)
        for index, (want, have) in enumerate(zip(expected, got)):
            assert (have.token_ids, have.finish_reason, have.text) == (want.token_ids, want.finish_reason, want.text), \
                f"{name}: example {example}, request {index}: {prompts[index]!r} with {params[index]}"
        assert not held_rows(llm), f"{name}: example {example}: rows held after every request finished"
        earlier += [g.text for g in expected if g.text]
        drafted += sum(o.metrics.spec.num_draft_tokens for o in got if o.metrics.spec is not None)
    assert drafted > 0  # (the runs speculated: otherwise they would prove nothing)
