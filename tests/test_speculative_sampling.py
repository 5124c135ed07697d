"""Monte-Carlo through the whole engine: speculative sampling with temperature, top-k and top-p
together emits tokens that follow the target's own warped distribution, with rows of two
warpings sharing every batch, for a draft model (plain and randomized drafting) and for prompt
lookup.

A request's first token comes from its prefill, which never drafts; its second to fourth come
from speculative steps (accepted, recovered and bonus tokens). The exact marginal of each
position is computed from the target alone by the chain rule, P(t1) P(t2 | t1) P(t3 | t1, t2) ...,
every factor the warped distribution `sampling_probs` gives, and the engine's counts at each
position are checked against it with Pearson's chi-square test.

Requests are unseeded (the global RNG, seeded here with torch.manual_seed), so nothing depends
on what a per-request seed means. The drafters are chosen so that a wrong verifier shows: a
draft model whose warped distributions overlap the target's by about half (drafts are accepted
and rejected, so the residual matters), and a target that continues the prompt's repeated
sentence about half the time (prompt lookup proposes tokens the target may well accept).
conftest's `random_draft` would not do: it overlaps tiny_qwen by under 2%, so nearly every draft
is rejected and the residual is p itself, and dropping the residual would go unseen.

Power, checked once with 800 requests per warping: the smallest p-value over the positions
(correct verifiers: every p above 0.01; "0": a token the target cannot emit; "-": not tried):
  verifier bug (in speculative steps only)        draft model   randomized a=0.5   prompt lookup
  recovered token drawn from p, not the residual      3e-16         2e-9             2e-32
  top-p left out of the target's distribution         0             -                0
  every row warped with the first row's settings      0             -                0
  randomized drafting's coin ignored (no tails)       -             3e-56            -
(Replacing a draft model's probabilities by a point mass on its token is no bug: accepting with
probability p(x) and recovering from p without x is lossless for any proposal, only less often
accepted; the test rightly passes it, at 11% acceptance instead of 45%.)
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftwise import LLM, SamplingParams
from draftwise.sampling.sampler import SamplingBatch, sampling_probs
from draftwise.text.tokenizer import Tokenizer
from tests.marginals import ALPHA, chain_rule_marginals, chi_square, sampled_positions_that_fail  # noqa: F401
from tests.tiny_models import write_tiny_model

REQUESTS_PER_SETTING = 800
NUM_POSITIONS = 4  # every token of a request
SETTINGS = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=NUM_POSITIONS, ignore_eos=True),
            SamplingParams(temperature=1.3, top_k=8, top_p=0.8, max_tokens=NUM_POSITIONS, ignore_eos=True)]
SENTENCE = "The quick brown fox jumps over the lazy dog."
COPY_LOGIT = 6.0  # the copying target's logit for the sentence's next token (p ~ 0.6 after warping)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and on a shared 2-core machine OpenMP's
    spinning threads made this file ten times slower (40 s instead of 4 s for 600 requests)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def save_model(weights: dict, source, destination) -> None:
    """The source folder's config and tokenizer with these weights (and no packed-weight cache)."""
    destination.mkdir(parents=True, exist_ok=True)
    for path in source.glob("*.json"):
        if destination != source:
            shutil.copy(path, destination / path.name)
    save_file(weights, str(destination / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def close_draft(tiny_qwen, tmp_path_factory):
    """tiny_qwen with noise on its LM head: its warped distributions overlap the target's by ~0.55."""
    weights = load_file(str(tiny_qwen / "model.safetensors"))
    noise = torch.randn(weights["lm_head.weight"].shape, generator=torch.Generator().manual_seed(0))
    weights["lm_head.weight"] = weights["lm_head.weight"] + 0.1 * noise
    folder = tmp_path_factory.mktemp("close_draft")
    save_model(weights, tiny_qwen, folder)
    return folder


@pytest.fixture(scope="module")
def copying_target(tmp_path_factory):
    """A bigram model (attention and MLP add nothing) that follows each token of SENTENCE with the
    sentence's next token: that token's logit is COPY_LOGIT, the others keep their random ones."""
    folder = write_tiny_model(tmp_path_factory.mktemp("copying"), "qwen2", seed=3, residual_scale=0.0)
    cycle = Tokenizer(folder).encode(" " + SENTENCE)  # one period of the sentence repeated
    assert len(set(cycle)) == len(cycle), cycle
    weights = load_file(str(folder / "model.safetensors"))
    eps = json.loads((folder / "config.json").read_text())["rms_norm_eps"]
    embed, norm, head = weights["model.embed_tokens.weight"], weights["model.norm.weight"], weights["lm_head.weight"]
    for token, successor in zip(cycle, cycle[1:] + cycle[:1]):
        hidden = norm * embed[token] * torch.rsqrt(embed[token].pow(2).mean() + eps)  # what the LM head reads
        head[successor] = COPY_LOGIT * hidden / hidden.pow(2).sum()
    save_model(weights, folder, folder)
    return folder


def exact_marginals(llm: LLM, prompt: str, params: SamplingParams, num_positions: int) -> list[dict[int, float]]:
    """P(token at position j) for j = 1..num_positions, from the target alone by the chain rule."""
    def warped(logits: torch.Tensor, keys: list) -> torch.Tensor:
        batch = SamplingBatch.build([params] * len(keys), [None] * len(keys), logits.shape[-1], logits.device)
        return sampling_probs(logits, batch)

    return chain_rule_marginals(llm, llm.tokenizer.encode(prompt), num_positions, warped)


def failed_positions(llm: LLM, prompt: str, num_requests: int = REQUESTS_PER_SETTING) -> list[str]:
    """Sample through the engine and test every position of every setting; returns the failures.
    Drafts must be both accepted and rejected, else the residual or the accepted path would go untested."""
    return sampled_positions_that_fail(llm, prompt, SETTINGS, num_requests, NUM_POSITIONS,
                                       lambda llm, params: exact_marginals(llm, prompt, params, NUM_POSITIONS),
                                       acceptance=(0.1, 0.9))


@pytest.mark.parametrize("draft_probability, branches", [(1.0, 1), (0.5, 1), (1.0, 3), (0.5, 2)])
def test_draft_model_sampling_follows_the_target(tiny_qwen, close_draft, draft_probability, branches):
    """branches > 1: token trees, siblings drawn without replacement (randomized drafting verifies
    their first children as a chain)."""
    llm = LLM(str(tiny_qwen), max_model_len=64, max_num_seqs=16, progress=False,
              speculative={"method": "draft", "model": str(close_draft), "num_speculative_tokens": 3,
                           "adaptive": False, "draft_probability": draft_probability, "draft_branches": branches})
    assert not failed_positions(llm, "def")
    if draft_probability < 1:  # the coin came up tails too: plain steps that draw from the residual
        assert llm.spec_metrics.num_plain_steps > 0.2 * llm.spec_metrics.num_drafts


def test_prompt_lookup_sampling_follows_the_target(copying_target):
    llm = LLM(str(copying_target), max_model_len=128, max_num_seqs=16, progress=False,
              speculative={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    assert not failed_positions(llm, " ".join([SENTENCE] * 8))
