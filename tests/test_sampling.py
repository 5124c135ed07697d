"""Sampling parameters, the logits warper and seeded sampling."""

import pytest
import torch

from draftwise.errors import InvalidParameterError
from draftwise.sampling.params import SamplingParams
from draftwise.sampling.sampler import SamplingBatch, sample, sampling_probs


def batch_of(*params, generators=None, vocab=6):
    return SamplingBatch.build(list(params), generators or [None] * len(params), vocab, torch.device("cpu"))


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"stop": [""]}, "stop"),
    ({"seed": "x"}, "seed"),
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


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    params = SamplingParams(temperature=1.0, seed=7)

    def draws(n):
        generator = torch.Generator().manual_seed(7)
        return [sample(logits, batch_of(params, generators=[generator], vocab=3)).item() for _ in range(n)]

    first, second = draws(3000), draws(3000)
    assert first == second
    frequencies = torch.bincount(torch.tensor(first), minlength=3).float() / len(first)
    torch.testing.assert_close(frequencies, torch.tensor([0.5, 0.3, 0.2]), atol=0.03, rtol=0)
