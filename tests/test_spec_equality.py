"""Speculative decoding equals plain greedy decoding token for token (fp32, CPU, tiny models).

Every comparison also checks that drafts were proposed (and accepted, where the drafter can be
right), so a drafter or a controller that silently never drafts fails here. Adaptive drafters
plan with a cost model on which drafting pays (the `drafting_pays` fixture): costs measured on
these tiny models may rightly say that it never does."""

import pytest
import torch

from draftwise import LLM, SamplingParams
from draftwise.errors import InvalidParameterError
from tests.drafting import assert_drafted, spec_totals
from tests.tiny_models import write_tiny_model

PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):\n    print(", "héllo wörld"]
REPETITIVE = "x = np.zeros((3, 4))\nx = np.zeros((3, 4))\nx = np.zeros((3, 4))\nx = np."
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def plain(tiny_qwen):
    return LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False)


def speculative(target, **spec):
    return LLM(str(target), max_model_len=256, max_num_seqs=8, progress=False, speculative=spec)


def assert_same(spec_llm, plain_llm, prompts, params, expect="accepted"):
    """Speculative output equals plain output, request by request and batched, and each of the two
    runs drafted: expect "accepted" (some drafted tokens kept), "proposed" (a drafter that is never
    right), or "nothing" (a setting where no step may draft; the caller says why)."""
    expected = [o.token_ids for o in plain_llm.generate(prompts, params)]
    solo = [spec_llm.generate(p, params)[0] for p in prompts]
    batched = spec_llm.generate(prompts, params)
    assert [o.token_ids for o in solo] == expected
    assert [o.token_ids for o in batched] == expected
    for run in (solo, batched):
        if expect == "nothing":
            assert spec_totals(run).num_draft_tokens == 0
        else:
            assert_drafted(run, accepted=expect == "accepted")


CONFIGS = {
    "draft=target": lambda target, draft, k: dict(method="draft", model=str(target), num_speculative_tokens=k),
    "random draft": lambda target, draft, k: dict(method="draft", model=str(draft), num_speculative_tokens=k),
    "ngram": lambda target, draft, k: dict(method="ngram", num_speculative_tokens=k),
    "layer_skip": lambda target, draft, k: dict(method="layer_skip", num_layers=1, num_speculative_tokens=k),
    "suffix": lambda target, draft, k: dict(method="suffix", num_speculative_tokens=k),
    "suffix tree": lambda target, draft, k: dict(method="suffix", num_speculative_tokens=k, suffix_max_branches=3),
    "draft=target tree": lambda target, draft, k: dict(method="draft", model=str(target), num_speculative_tokens=k,
                                                       draft_branches=2),
    "random draft tree": lambda target, draft, k: dict(method="draft", model=str(draft), num_speculative_tokens=k,
                                                       draft_branches=3),
    "suffix_draft=target": lambda target, draft, k: dict(method="suffix_draft", model=str(target),
                                                         num_speculative_tokens=k),
    "suffix_draft random": lambda target, draft, k: dict(method="suffix_draft", model=str(draft),
                                                         num_speculative_tokens=k),
}
# What each drafter's drafts come to on tiny_qwen. The random model does not continue its prompt,
# so prompt lookup (which does propose on REPETITIVE) is never right here; test_ngram_partial_acceptance
# checks acceptance on a model that repeats itself.
# Suffix decoding drafts from REPETITIVE (its own text) and, in the batched run, from the solo run's
# outputs in its cache, which are right: test_suffix.py checks that acceptance.
EXPECT = {"draft=target": "accepted", "random draft": "proposed", "ngram": "proposed", "layer_skip": "accepted",
          "suffix": "proposed", "suffix tree": "proposed", "draft=target tree": "accepted",
          "random draft tree": "proposed", "suffix_draft=target": "accepted", "suffix_draft random": "proposed"}


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equality(name, k, adaptive, tiny_qwen, random_draft, plain, drafting_pays):
    llm = speculative(tiny_qwen, **CONFIGS[name](tiny_qwen, random_draft, k), adaptive=adaptive)
    assert_same(llm, plain, PROMPTS + [REPETITIVE], GREEDY, EXPECT[name])
    metrics = llm.spec_metrics
    if name == "draft=target":
        assert metrics.acceptance_rate == 1.0 and metrics.mean_acceptance_length > 1
    if name == "draft=target tree":  # every drafted chain token kept (at every depth), no leaf beside it
        assert metrics.accepted_per_position == metrics.drafted_per_position
        assert metrics.num_draft_tokens > metrics.num_accepted_tokens  # (leaves were drafted)
    if name == "random draft":
        assert metrics.acceptance_rate < 0.3


class CyclingLength:
    """A draft-length policy that walks through a fixed pattern of k, plain steps (k = 0) included."""

    def __init__(self, pattern):
        self.pattern, self.step = pattern, 0

    def num_tokens(self, seqs, lags, batch_size=None):
        self.step += 1
        return [self.pattern[(self.step + b) % len(self.pattern)] for b in range(len(seqs))]

    def observe(self, seq, num_drafted, num_accepted):
        pass

    def release(self, seq):
        pass


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equality_with_plain_steps_between_drafts(name, tiny_qwen, random_draft, plain):
    """k changing every step, with runs of k = 0: a draft model must catch up on what it missed."""
    llm = speculative(tiny_qwen, **CONFIGS[name](tiny_qwen, random_draft, 6), adaptive=False)
    llm.engine.drafters[llm.default_method].draft_length = CyclingLength([0, 3, 0, 0, 1, 6, 0, 2, 5])
    assert_same(llm, plain, PROMPTS + [REPETITIVE], GREEDY, EXPECT[name])
    assert llm.spec_metrics.num_plain_steps > 0


@pytest.mark.parametrize("setting", [
    {"draft_confidence_threshold": 0.6},
    {"draft_vocab_size": 40},
    {"draft_probability": 0.5},
    {"draft_context_window": 3},
    {"draft_confidence_threshold": 0.3, "draft_vocab_size": 64, "draft_probability": 0.7},
])
@pytest.mark.parametrize("drafter", ["draft=target", "random draft", "layer_skip"])
def test_greedy_equality_for_every_controller_setting(setting, drafter, tiny_qwen, random_draft, plain,
                                                     drafting_pays):
    config = CONFIGS[drafter](tiny_qwen, random_draft, 5)
    if drafter == "layer_skip" and ("draft_vocab_size" in setting or "draft_context_window" in setting):
        pytest.skip("the trimmed head and the context window belong to a separate draft model")
    for adaptive in (False, True):
        llm = speculative(tiny_qwen, **config, **setting, adaptive=adaptive)
        assert_same(llm, plain, PROMPTS + [REPETITIVE], GREEDY, EXPECT[drafter])


def test_draft_context_window_bounds_the_catch_up_and_restarts_after_plain_steps(tiny_qwen, plain):
    """The target as its own draft accepts everything with the whole context and less with a
    3-token window; runs of plain steps push the backlog past the window, so the draft cache restarts."""
    whole = speculative(tiny_qwen, method="draft", model=str(tiny_qwen), num_speculative_tokens=4, adaptive=False,
                        draft_context_window=None)
    windowed = speculative(tiny_qwen, method="draft", model=str(tiny_qwen), num_speculative_tokens=4,
                           adaptive=False, draft_context_window=3)
    windowed.engine.drafters["draft"].draft_length = CyclingLength([0, 0, 0, 0, 0, 4, 2, 0, 0, 0, 0, 0, 0, 3])
    lags = []
    proposer = windowed.engine.drafters["draft"].proposer
    lag = proposer.lag
    proposer.lag = lambda seq: lags.append(lag(seq)) or lags[-1]
    assert_same(whole, plain, PROMPTS, GREEDY)
    # Proposed only: from 3 tokens of context the random model seldom predicts what it predicts from all.
    assert_same(windowed, plain, PROMPTS + [REPETITIVE], GREEDY, "proposed")
    assert whole.spec_metrics.acceptance_rate == 1.0
    assert windowed.spec_metrics.acceptance_rate < 1.0
    assert max(lags) == 3  # never more than the window to catch up on


def test_confidence_stop_shortens_drafts(tiny_qwen, random_draft):
    def mean_draft_length(threshold):
        llm = speculative(tiny_qwen, method="draft", model=str(random_draft), num_speculative_tokens=6,
                          adaptive=False, draft_confidence_threshold=threshold)
        llm.generate(PROMPTS, GREEDY)
        return llm.spec_metrics.num_draft_tokens / llm.spec_metrics.num_drafts

    assert mean_draft_length(0.0) == 6 or mean_draft_length(0.0) > 5  # only max_tokens cuts drafts short
    assert mean_draft_length(0.9) < 3


def test_trimmed_draft_vocabulary_only_proposes_kept_tokens(tiny_qwen):
    from draftwise.speculative.vocab_trim import kept_token_ids

    llm = speculative(tiny_qwen, method="draft", model=str(tiny_qwen), num_speculative_tokens=4, adaptive=False,
                      draft_vocab_size=40)
    kept = set(kept_token_ids(llm.tokenizer, 40).tolist())
    assert len(kept) == 40 and llm.tokenizer.special_token_ids <= kept
    drafted = []
    proposer = llm.engine.drafters[llm.default_method].proposer
    original = proposer.propose
    proposer.propose = lambda seqs, k: [drafted.extend(d.token_ids) or d for d in original(seqs, k)]
    llm.generate(PROMPTS, GREEDY)
    assert drafted and set(drafted) <= kept
    assert llm.spec_metrics.acceptance_rate < 1.0  # the full-vocabulary draft=target accepts everything


def test_randomized_drafting_takes_plain_steps_for_unseeded_sampled_requests(tiny_qwen):
    """(Seeded requests are verified by equality against the target's keyed draws, where the coin
    has nothing to adjust: it applies to unseeded sampled requests.)"""
    llm = speculative(tiny_qwen, method="draft", model=str(tiny_qwen), num_speculative_tokens=3, adaptive=False,
                      draft_probability=0.5)
    params = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)
    torch.manual_seed(7)
    first = [o.token_ids for o in llm.generate(PROMPTS, params)]
    torch.manual_seed(7)
    assert first == [o.token_ids for o in llm.generate(PROMPTS, params)]
    metrics = llm.spec_metrics
    assert metrics.num_plain_steps > 0.2 * (metrics.num_plain_steps + metrics.num_drafts)
    assert metrics.num_accepted_tokens > 0  # the heads steps drafted, and the target as its own draft is right


@pytest.fixture(scope="module")
def looping_target(tmp_path_factory):
    """A tiny model whose greedy output soon repeats itself, as real text often does."""
    return write_tiny_model(tmp_path_factory.mktemp("looping"), "qwen2", seed=0, residual_scale=0.05)


@pytest.mark.parametrize("k", [2, 4])
def test_ngram_partial_acceptance(looping_target, k, drafting_pays):
    plain_llm = LLM(str(looping_target), max_model_len=256, progress=False)
    llm = speculative(looping_target, method="ngram", num_speculative_tokens=k)
    params = SamplingParams(temperature=0, max_tokens=40)
    assert_same(llm, plain_llm, PROMPTS, params)
    metrics = llm.spec_metrics  # (some drafted tokens accepted and some not: where a loop begins is the model's)
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7, 13])
def test_max_tokens_inside_an_accepted_run(max_tokens, tiny_qwen, plain, drafting_pays):
    llm = speculative(tiny_qwen, method="draft", model=str(tiny_qwen), num_speculative_tokens=5)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # max_tokens 1: the prefill emits the only token; 2: the one decode step may emit one token,
    # and a draft never reaches past what the request may still emit (k <= tokens left - 1 = 0).
    assert_same(llm, plain, PROMPTS, params, "accepted" if max_tokens > 2 else "nothing")
    assert all(len(o.token_ids) == max_tokens for o in llm.generate(PROMPTS, params))


@pytest.mark.parametrize("eos_index", [0, 2, 4])
def test_eos_inside_an_accepted_run(eos_index, tiny_qwen, plain, monkeypatch, drafting_pays):
    llm = speculative(tiny_qwen, method="draft", model=str(tiny_qwen), num_speculative_tokens=5)
    full = plain.generate(PROMPTS[0], GREEDY)[0].token_ids
    eos = full[eos_index]
    for target in (llm, plain):
        monkeypatch.setattr(target.tokenizer, "eos_token_ids", frozenset({eos}))
    out = llm.generate(PROMPTS[0], GREEDY)[0]
    assert out.token_ids == full[:full.index(eos) + 1] and out.finish_reason == "stop"
    if full.index(eos) > 0:  # (EOS as the first token comes from the prefill: nothing to draft)
        assert_drafted([out])
    assert_same(llm, plain, PROMPTS, GREEDY)


def test_stop_string_inside_an_accepted_run(tiny_qwen, plain, drafting_pays):
    llm = speculative(tiny_qwen, method="draft", model=str(tiny_qwen), num_speculative_tokens=6)
    text = plain.generate(PROMPTS[1], GREEDY)[0].text
    # a 3-character stop string first seen at position >= 5 (no partial-character marks in it)
    start = next(i for i in range(5, len(text) - 3) if text.find(text[i:i + 3]) == i and "\ufffd" not in text[i:i + 3])
    params = SamplingParams(temperature=0, max_tokens=24, stop=[text[start:start + 3]])
    out = llm.generate(PROMPTS[1], params)[0]
    assert out.text == plain.generate(PROMPTS[1], params)[0].text == text[:start]
    assert_drafted([out])


def test_seeded_speculative_sampling_is_reproducible(tiny_qwen, random_draft, drafting_pays):
    llm = speculative(tiny_qwen, method="draft", model=str(random_draft), num_speculative_tokens=3)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=4, max_tokens=20)
    first = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert_drafted(first, accepted=False)


@pytest.mark.parametrize("spec, message", [
    ({"method": "no_such_drafter"}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "lookahead": 3}, "unknown option.*lookahead"),
    ({"num_speculative_tokens": 3}, "needs a 'method'"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "draft", "draft_confidence_threshold": 1.5}, "draft_confidence_threshold"),
    ({"method": "draft", "draft_vocab_size": 3}, "draft_vocab_size"),
    ({"method": "draft", "draft_context_window": -1}, "draft_context_window"),
    ({"method": "draft", "draft_context_window": False}, "draft_context_window"),
    ({"method": "draft", "draft_probability": 0}, "draft_probability"),
    ({"method": "ngram", "adaptive": "yes"}, "adaptive"),
])
def test_bad_speculative_config(tiny_qwen, spec, message):
    with pytest.raises(InvalidParameterError, match=message):
        LLM(str(tiny_qwen), speculative=spec, progress=False)


def test_zero_means_none_in_the_dict_as_on_the_command_line():
    """An option documented "0: all" takes 0 from the dict API too (the CLI maps it the same way)."""
    from draftwise.speculative.registry import drafter_spec

    options = drafter_spec("draft").parse_options({"draft_context_window": 0, "draft_vocab_size": 0})
    assert options.draft_context_window is None and options.draft_vocab_size is None
    assert drafter_spec("draft").parse_options({"draft_context_window": 5}).draft_context_window == 5
