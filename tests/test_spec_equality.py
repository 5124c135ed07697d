"""Speculative decoding equals plain greedy decoding token for token (fp32, CPU, tiny models)."""

import pytest

from draftwise import LLM, SamplingParams
from draftwise.errors import InvalidParameterError
from tests.tiny_models import write_tiny_model

PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):\n    print(", "héllo wörld"]
REPETITIVE = "x = np.zeros((3, 4))\nx = np.zeros((3, 4))\nx = np.zeros((3, 4))\nx = np."
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """Another random model with the same tokenizer: it agrees with the target almost never."""
    return write_tiny_model(tmp_path_factory.mktemp("random_draft"), "qwen2", seed=5, num_layers=1)


@pytest.fixture(scope="module")
def plain(tiny_qwen):
    return LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False)


def speculative(target, **spec):
    return LLM(str(target), max_model_len=256, max_num_seqs=8, progress=False, speculative=spec)


def assert_same(spec_llm, plain_llm, prompts, params):
    expected = [o.token_ids for o in plain_llm.generate(prompts, params)]
    solo = [spec_llm.generate(p, params)[0].token_ids for p in prompts]
    batched = [o.token_ids for o in spec_llm.generate(prompts, params)]
    assert solo == expected
    assert batched == expected


CONFIGS = {
    "draft=target": lambda target, draft, k: dict(method="draft", model=str(target), num_speculative_tokens=k),
    "random draft": lambda target, draft, k: dict(method="draft", model=str(draft), num_speculative_tokens=k),
    "ngram": lambda target, draft, k: dict(method="ngram", num_speculative_tokens=k),
    "layer_skip": lambda target, draft, k: dict(method="layer_skip", num_layers=1, num_speculative_tokens=k),
}


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equality(name, k, tiny_qwen, random_draft, plain):
    llm = speculative(tiny_qwen, **CONFIGS[name](tiny_qwen, random_draft, k))
    assert_same(llm, plain, PROMPTS + [REPETITIVE], GREEDY)
    metrics = llm.spec_metrics
    assert metrics.num_draft_tokens > 0
    if name == "draft=target":
        assert metrics.acceptance_rate == 1.0 and metrics.mean_acceptance_length > 1
    if name == "random draft":
        assert metrics.acceptance_rate < 0.3


@pytest.fixture(scope="module")
def looping_target(tmp_path_factory):
    """A tiny model whose greedy output soon repeats itself, as real text often does."""
    return write_tiny_model(tmp_path_factory.mktemp("looping"), "qwen2", seed=0, residual_scale=0.05)


@pytest.mark.parametrize("k", [2, 4])
def test_ngram_partial_acceptance(looping_target, k):
    plain_llm = LLM(str(looping_target), max_model_len=256, progress=False)
    llm = speculative(looping_target, method="ngram", num_speculative_tokens=k)
    params = SamplingParams(temperature=0, max_tokens=40)
    assert_same(llm, plain_llm, PROMPTS, params)
    assert 0.05 < llm.spec_metrics.acceptance_rate < 0.95


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7, 13])
def test_max_tokens_inside_an_accepted_run(max_tokens, tiny_qwen, plain):
    llm = speculative(tiny_qwen, method="draft", model=str(tiny_qwen), num_speculative_tokens=5)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    assert_same(llm, plain, PROMPTS, params)
    assert all(len(o.token_ids) == max_tokens for o in llm.generate(PROMPTS, params))


@pytest.mark.parametrize("eos_index", [0, 2, 4])
def test_eos_inside_an_accepted_run(eos_index, tiny_qwen, plain, monkeypatch):
    llm = speculative(tiny_qwen, method="draft", model=str(tiny_qwen), num_speculative_tokens=5)
    full = plain.generate(PROMPTS[0], GREEDY)[0].token_ids
    eos = full[eos_index]
    for target in (llm, plain):
        monkeypatch.setattr(target.tokenizer, "eos_token_ids", frozenset({eos}))
    out = llm.generate(PROMPTS[0], GREEDY)[0]
    assert out.token_ids == full[:full.index(eos) + 1] and out.finish_reason == "stop"
    assert_same(llm, plain, PROMPTS, GREEDY)


def test_stop_string_inside_an_accepted_run(tiny_qwen, plain):
    llm = speculative(tiny_qwen, method="draft", model=str(tiny_qwen), num_speculative_tokens=6)
    text = plain.generate(PROMPTS[1], GREEDY)[0].text
    params = SamplingParams(temperature=0, max_tokens=24, stop=[text[5:8]])
    assert llm.generate(PROMPTS[1], params)[0].text == plain.generate(PROMPTS[1], params)[0].text == text[:5]


def test_seeded_speculative_sampling_is_reproducible(tiny_qwen, random_draft):
    llm = speculative(tiny_qwen, method="draft", model=str(random_draft), num_speculative_tokens=3)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=4, max_tokens=20)
    first = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert first == [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("spec, message", [
    ({"method": "medusa"}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "lookahead": 3}, "unknown speculative option"),
    ({"num_speculative_tokens": 3}, "needs a 'method'"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
])
def test_bad_speculative_config(tiny_qwen, spec, message):
    with pytest.raises(InvalidParameterError, match=message):
        LLM(str(tiny_qwen), speculative=spec, progress=False)
