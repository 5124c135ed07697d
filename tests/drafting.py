"""What equality tests need to be able to fail: proof that drafting happened, and a cost model on
which the adaptive controller drafts (measured costs on a tiny model may rightly say it never pays,
and an equality test that never drafts proves nothing)."""

from __future__ import annotations

from draftwise.speculative.control.cost_model import CostModel
from draftwise.speculative.metrics import SpecMetrics

# A GPU-like machine: a target pass costs the same for 1 to 64 tokens, a drafted token 1% of it.
# The adaptive controller then drafts (k up to its maximum while acceptance is high, and still
# k = 1 at an acceptance of a few percent), so its choices follow acceptance, not this machine's speed.
DRAFTING_PAYS = CostModel({n: 0.010 for n in (1, 2, 4, 8, 16, 32, 64)},
                          {k: 0.0001 * k for k in range(1, 17)}, catch_up=0.0, key="tests: drafting pays")


def spec_totals(outputs) -> SpecMetrics:
    """The speculation counters of these request outputs, summed."""
    total = SpecMetrics()
    for output in outputs:
        total.merge(output.metrics.spec)
    return total


def assert_drafted(outputs, accepted: bool = True) -> SpecMetrics:
    """Drafts were proposed for these outputs (and some drafted tokens accepted, if `accepted`)."""
    total = spec_totals(outputs)
    assert total.num_draft_tokens > 0, f"nothing was drafted, so the comparison proves nothing: {total}"
    if accepted:
        assert total.num_accepted_tokens > 0, f"no drafted token was accepted: {total}"
    return total


def assert_constrained_equal(llm, plain, prompts: list[str], accepted: bool = True) -> None:
    """Under a grammar the drafter knows nothing of (any text without '#' or '@', up to 200 characters:
    most of its drafts stay inside, some are cut), the output equals plain constrained decoding's,
    alone and batched, and drafts were proposed (and accepted)."""
    from draftwise import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs={"regex": "[^#@]{1,200}"})
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    solo = [llm.generate(p, params)[0] for p in prompts]
    batched = llm.generate(prompts, params)
    assert [o.token_ids for o in solo] == expected and [o.token_ids for o in batched] == expected
    assert_drafted(solo + batched, accepted=accepted)


# Drafters every feature that changes what a position's logits are (grammars, processors, logprobs)
# is checked against: the target drafting for itself (everything accepted), a random model (nothing
# accepted), the target's trees, prompt lookup, suffix decoding, layer skip. (target, draft) -> spec.
DRAFTERS = {
    "draft=target": lambda target, draft: dict(method="draft", model=str(target), num_speculative_tokens=4),
    "random draft": lambda target, draft: dict(method="draft", model=str(draft), num_speculative_tokens=3),
    "draft=target tree": lambda target, draft: dict(method="draft", model=str(target), num_speculative_tokens=4,
                                                    draft_branches=2),
    "ngram": lambda target, draft: dict(method="ngram", num_speculative_tokens=4),
    "suffix": lambda target, draft: dict(method="suffix", num_speculative_tokens=4),
    "layer_skip": lambda target, draft: dict(method="layer_skip", num_layers=1, num_speculative_tokens=3),
}


def held_rows(llm) -> dict[str, int]:
    """Cache rows still held, by owner (the target's runner, and every drafter's own runner): with no
    request left, a row held is a leak (it keeps a block table, and blocks, forever)."""
    runners = {"target": llm.runner}
    for method, drafter in llm.engine.drafters.items():
        runner = getattr(drafter.proposer, "runner", None)
        if runner is not None and runner is not llm.runner:
            runners[method] = runner
    return {owner: len(runner.blocks.tables) for owner, runner in runners.items() if runner.blocks.tables}
