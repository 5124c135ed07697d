"""The lossless checks every new architecture runs on its tiny random checkpoint (MoE, Qwen3, Gemma 3):
a row's logits independent of its pass, and speculative output equal to plain decoding."""

from __future__ import annotations

import torch

from draftwise import LLM, SamplingParams
from tests.drafting import DRAFTERS, assert_drafted


def assert_row_logits_independent_of_pass(folder, quantization: str, tokens: list[int]) -> None:
    """The same token's logits alone, as the last of a 5-token verification, and beside other rows
    (tokens: 40 ids)."""
    llm = LLM(str(folder), max_model_len=256, max_num_seqs=4, progress=False, quantization=quantization)
    runner, ids = llm.runner, tokens[:20]
    alone = runner.allocate()
    runner.forward([alone], [ids[:15]], [1])
    for token in ids[15:19]:
        runner.forward([alone], [[token]], [1])
    single = runner.forward([alone], [[ids[19]]], [1]).logits[0]
    verifying, other = runner.allocate(), runner.allocate()
    runner.forward([verifying, other], [ids[:15], tokens[20:35]], [1, 1])
    batched = runner.forward([verifying, other], [ids[15:20], tokens[35:40]], [5, 5]).logits[4]
    assert torch.equal(single, batched)


def assert_speculation_equals_plain(folder, drafter: str, quantization: str, random_draft, prompts: list[str]) -> None:
    """Greedy output with `drafter` (a `DRAFTERS` name) equal to plain decoding's, alone and batched;
    the target drafting for itself in a chain accepts everything (a tree's side leaves are refused by design)."""
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = LLM(str(folder), max_model_len=256, max_num_seqs=4, progress=False, quantization=quantization)
    spec = DRAFTERS[drafter](folder, random_draft)
    if spec["method"] == "draft":  # (the draft model's weights as the target's: the same logits)
        spec["quantization"] = quantization
    llm = LLM(str(folder), max_model_len=256, max_num_seqs=4, progress=False, quantization=quantization,
              speculative=spec)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    solo = [llm.generate(p, params)[0] for p in prompts]
    batched = llm.generate(prompts, params)
    assert [o.token_ids for o in solo] == expected and [o.token_ids for o in batched] == expected
    assert_drafted(solo + batched, accepted=drafter.startswith("draft=target"))
    if drafter == "draft=target":
        assert llm.spec_metrics.acceptance_rate == 1.0
