"""What a drafter costs in memory: its weights and KV cache, and how many fewer sequences then fit."""

from __future__ import annotations

from draftwise.planner.plan import DrafterFacts
from draftwise.planner.simulate import Request
from draftwise.runner.model_runner import ModelRunner


def memory_report(llm, drafters: list[DrafterFacts], requests: list[Request]) -> dict[str, dict]:
    """Per drafter: what it adds, and how many mean-length sequences fit in the target's KV budget
    without it and with it (weights taken from the budget, its KV per token added to each)."""
    target_kv = ModelRunner.kv_bytes_per_token(llm.model)
    budget = llm.runner.blocks.num_blocks * llm.runner.blocks.block_size * target_kv
    context = sum(r.prompt_tokens + r.output_tokens for r in requests) / max(1, len(requests))
    plain_fit = int(budget // (context * target_kv))
    report = {}
    for facts in drafters:
        with_drafter = int(max(0, budget - facts.weights_bytes) // (context * (target_kv + facts.kv_bytes_per_token)))
        report[facts.method] = {"weights_bytes": facts.weights_bytes, "kv_bytes_per_token": facts.kv_bytes_per_token,
                                "kv_budget_bytes": budget, "mean_context_tokens": context,
                                "sequences_fit_plain": plain_fit, "sequences_fit_with_drafter": with_drafter}
    return report
