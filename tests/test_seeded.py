"""Seeded sampling is a function of the prompt and the seed alone: the same tokens alone or in a
batch of speculating rows, with any drafter or none (the coupling in draftwise/speculative/verify.py)."""

import pytest
import torch

from draftwise import LLM, SamplingParams

PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):\n    print(", "héllo wörld",
           "x = np.zeros((3, 4))\nx = np.zeros((3, 4))\nx = np.", "import numpy as np", "quicksort", "print("]
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234, max_tokens=24, ignore_eos=True)

SPECS = {
    "draft=target": lambda target, draft: dict(method="draft", model=str(target), num_speculative_tokens=4),
    "random draft": lambda target, draft: dict(method="draft", model=str(draft), num_speculative_tokens=3),
    "ngram": lambda target, draft: dict(method="ngram", num_speculative_tokens=3),
}


def build(target, spec=None):
    return LLM(str(target), max_model_len=256, max_num_seqs=8, progress=False, speculative=spec)


@pytest.fixture(scope="module")
def plain_seeded(tiny_qwen):
    llm = build(tiny_qwen)
    return [llm.generate(prompt, SEEDED)[0].token_ids for prompt in PROMPTS]


@pytest.mark.parametrize("name", list(SPECS))
def test_seeded_speculative_equals_seeded_plain_alone_and_in_a_batch(name, tiny_qwen, random_draft, plain_seeded):
    llm = build(tiny_qwen, {**SPECS[name](tiny_qwen, random_draft), "adaptive": False})
    torch.manual_seed(0)
    alone = llm.generate(PROMPTS[0], SEEDED)[0].token_ids
    # The same request among 7 others that speculate with their own (unseeded) sampling.
    others = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    torch.manual_seed(1)
    ids = [llm.add_request(PROMPTS[0], SEEDED)] + [llm.add_request(p, others) for p in PROMPTS[1:]]
    finished = {}
    while llm.has_unfinished_requests():
        finished.update({o.request_id: o for o in llm.step() if o.finished})
    assert alone == finished[ids[0]].token_ids == plain_seeded[0]
    metrics = llm.spec_metrics
    assert metrics.num_draft_tokens > 0
    if name == "draft=target":  # the target drafting for itself with the same noise: everything accepted
        assert finished[ids[0]].metrics.spec.acceptance_rate == 1.0
    # Every prompt, all seeded, batched: each equals its plain seeded output.
    assert [o.token_ids for o in llm.generate(PROMPTS, SEEDED)] == plain_seeded


def test_seeds_give_different_samples_that_follow_the_target(tiny_qwen):
    """Over many seeds the first token follows the target's warped distribution (chi-square)."""
    from draftwise.sampling.sampler import SamplingBatch, sampling_probs

    llm = build(tiny_qwen)
    params = [SamplingParams(temperature=1.0, top_k=8, seed=seed, max_tokens=1) for seed in range(600)]
    ids = [llm.add_request(PROMPTS[0], p) for p in params]
    first = {}
    while llm.has_unfinished_requests():
        first.update({o.request_id: o.token_ids[0] for o in llm.step() if o.finished})
    row = llm.runner.allocate()
    prompt_ids = llm.tokenizer.encode(PROMPTS[0])
    logits = llm.runner.forward([row], [prompt_ids], [1]).logits
    llm.runner.free(row)
    probs = sampling_probs(logits, SamplingBatch.build(params[:1], [0], logits.shape[-1], logits.device))[0]
    observed = torch.bincount(torch.tensor([first[i] for i in ids]), minlength=probs.shape[0]).double()
    support = probs > 0
    expected = probs.double() * len(ids)
    chi2 = float(((observed[support] - expected[support]) ** 2 / expected[support]).sum())
    assert observed[~support].sum() == 0
    assert chi2 < 24.32  # chi-square, 7 degrees of freedom, alpha = 0.001
