"""Sampling parameters, the logits warper and seeded sampling."""

import pytest
import torch

from draftwise.errors import InvalidParameterError
from draftwise.sampling.params import SamplingParams
from draftwise.sampling.sampler import SamplingBatch, sample, sampling_probs


def batch_of(*params, positions=None, vocab=6):
    return SamplingBatch.build(list(params), positions or [0] * len(params), vocab, torch.device("cpu"))


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"stop": [""]}, "stop"),
    ({"seed": "x"}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"seed": True}, "seed"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"max_tokens": True}, "max_tokens"),
    ({"stop": ["ok", "bad\ud800"]}, "stop\\[1\\] is not valid Unicode.*U\\+D800"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stop": 5}, "stop must be a string or a list"),
    ({"bad_words": 5}, "bad_words must be a list"),
])
def test_bad_parameters_are_named(kwargs, message):
    with pytest.raises(InvalidParameterError, match=message):
        SamplingParams(**kwargs)


def test_top_k_and_top_p_cut_the_distribution():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05, 0.0]]))
    probs = sampling_probs(logits, batch_of(SamplingParams(top_k=2)))
    torch.testing.assert_close(probs[0], torch.tensor([4 / 7, 3 / 7, 0, 0, 0, 0]))
    probs = sampling_probs(logits, batch_of(SamplingParams(top_p=0.8)))  # 0.4 + 0.3 < 0.8 <= 0.85
    torch.testing.assert_close(probs[0], torch.tensor([0.4, 0.3, 0.15, 0, 0, 0]) / 0.85)
    probs = sampling_probs(logits, batch_of(SamplingParams(top_p=0.7, top_k=3)))
    torch.testing.assert_close(probs[0], torch.tensor([0.4, 0.3, 0, 0, 0, 0]) / 0.7)
    probs = sampling_probs(logits, batch_of(SamplingParams(temperature=2.0)))
    expected = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0]).sqrt()
    torch.testing.assert_close(probs[0], expected / expected.sum())


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    batch = batch_of(SamplingParams(temperature=0), SamplingParams(temperature=100.0), vocab=3)
    assert {sample(logits, batch)[0].item() for _ in range(20)} == {1}


def test_seeded_sampling_is_keyed_by_seed_and_position_and_follows_the_distribution():
    """A seeded draw depends on the seed and the output position only; over seeds it follows p."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))

    def draw(seed, position):
        return sample(logits, batch_of(SamplingParams(temperature=1.0, seed=seed), positions=[position], vocab=3)).item()

    torch.manual_seed(0)
    first = [draw(seed, 5) for seed in range(3000)]
    torch.manual_seed(1)  # the global generator plays no part
    assert first == [draw(seed, 5) for seed in range(3000)]
    assert [draw(seed, 6) for seed in range(200)] != first[:200]  # another position, other noise
    frequencies = torch.bincount(torch.tensor(first), minlength=3).float() / len(first)
    torch.testing.assert_close(frequencies, torch.tensor([0.5, 0.3, 0.2]), atol=0.03, rtol=0)


def test_a_seeded_row_draws_the_same_beside_any_rows():
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=1.0, seed=9), SamplingParams(temperature=0.7),
              SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=9)]
    alone = sample(logits[:1], SamplingBatch.build(params[:1], [3], 50, torch.device("cpu"))).item()
    together = sample(logits[[0, 1, 2, 0]], SamplingBatch.build(params, [3, 0, 0, 3], 50, torch.device("cpu")))
    assert together[0].item() == together[3].item() == alone


def test_top_k_beyond_the_vocabulary_means_no_cut():
    batch = SamplingBatch.build([SamplingParams(top_k=2**63 - 1)], [0], 6, torch.device("cpu"))
    assert batch.top_k.tolist() == [6]

@pytest.mark.parametrize("temperature", [1e-6, 1e-40, 1e-50])
def test_a_temperature_below_the_greedy_threshold_is_greedy(temperature):
    """vLLM's rule: under 1e-5 the request is greedy (logits / 1e-40 overflow float32 into NaNs)."""
    params = SamplingParams(temperature=temperature, seed=3)
    assert params.greedy
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    batch = batch_of(params, vocab=3)
    assert batch.all_greedy and batch.seeds == [None]
    assert sample(logits, batch).tolist() == [1]


@pytest.mark.parametrize("top_p", [1e-9, 1e-40, 1e-50])
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p):
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    probs = sampling_probs(logits, batch_of(SamplingParams(temperature=1.0, top_p=top_p), vocab=3))
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


def test_a_row_at_top_p_one_cuts_nothing_when_another_row_sorts():
    """One row's distribution does not depend on another row's top-p (float32 sums of a wide
    vocabulary fall short of 1 and would cut the tail of a row that asked for no cut)."""
    torch.manual_seed(0)
    logits = torch.randn(1, 150_000) * 4  # a long, thin tail
    alone = sampling_probs(logits, batch_of(SamplingParams(temperature=1.0), vocab=150_000))
    beside = sampling_probs(logits.repeat(2, 1), batch_of(SamplingParams(temperature=1.0),
                                                          SamplingParams(temperature=1.0, top_p=0.5), vocab=150_000))
    assert torch.equal(beside[0], alone[0])
    assert (beside[0] > 0).all()


def test_an_overflowing_logit_samples_a_token_not_nans():
    """A logit divided by a tiny repetition_penalty (+inf) stays the most likely token, sampled."""
    logits = torch.tensor([[1.0, float("inf"), 0.5]])
    probs = sampling_probs(logits, batch_of(SamplingParams(temperature=0.7, seed=1), vocab=3))
    assert not probs.isnan().any() and probs.argmax().item() == 1
    assert sample(logits, batch_of(SamplingParams(temperature=0.7, seed=1), vocab=3)).tolist() == [1]
