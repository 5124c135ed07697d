"""Continuous batching: each request's output in a batch equals its output alone (greedy, fp32),
whatever the batch, the arrivals, the drafter or the preemptions; KV blocks are never leaked.
Every speculative run also shows that it drafted (and had drafts accepted, where the drafter
can be right): an equality between runs that never drafted would prove nothing."""

import pytest

from draftwise import LLM, SamplingParams
from draftwise.speculative.control.policy import FixedLength
from draftwise.speculative.drafter import Drafter
from draftwise.errors import PromptTooLongError
from draftwise.runner.model_runner import ModelRunner
from draftwise.speculative.proposer import Draft
from draftwise.text.tokenizer import Tokenizer
from tests.drafting import assert_drafted, spec_totals

WORDS = "def add return value print the quick brown fox for range list dict x y z".split()
# Prompts of mixed lengths (1 to ~40 tokens), some repetitive (prompt lookup finds matches).
PROMPTS = [" ".join(WORDS[(i * 7) % len(WORDS):] + WORDS[: i % 5]) * (1 + i % 3) for i in range(16)]
PROMPTS[3] = "x"
GREEDY = SamplingParams(temperature=0, max_tokens=20)


@pytest.fixture(scope="module")
def solo_outputs(tiny_qwen):
    llm = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=1, progress=False)
    return {prompt: llm.generate(prompt, GREEDY)[0].token_ids for prompt in PROMPTS}


DRAFTERS = {
    "plain": lambda target, draft: None,
    "draft=target": lambda target, draft: dict(method="draft", model=str(target), num_speculative_tokens=4),
    "random draft": lambda target, draft: dict(method="draft", model=str(draft), num_speculative_tokens=3),
    "ngram": lambda target, draft: dict(method="ngram", num_speculative_tokens=3),
    "layer_skip": lambda target, draft: dict(method="layer_skip", num_layers=1, num_speculative_tokens=3),
}
# Whether each drafter's drafts are ever right on tiny_qwen (the random models never agree, and
# the random target does not continue its prompts, so prompt lookup only proposes).
ACCEPTS = {"draft=target": True, "random draft": False, "ngram": False, "layer_skip": True}


def assert_drafted_as_expected(drafter, outputs):
    """A speculative run drafted (and had drafts accepted where the drafter can be right); plain did not."""
    if drafter == "plain":
        assert spec_totals(outputs).num_draft_tokens == 0
    else:
        assert_drafted(outputs, accepted=ACCEPTS[drafter])


def build(target, draft, drafter, adaptive=False, **kwargs):
    spec = DRAFTERS[drafter](target, draft)
    if spec is not None:
        spec["adaptive"] = adaptive
    return LLM(str(target), max_model_len=256, progress=False, speculative=spec, **kwargs)


def run_checking_blocks(llm, prompts, params, arrivals=None, preempt_at=()):
    """Add `prompts` (and, after the given step numbers, more), step to the end checking the block
    manager after every step (and preempting the latest running request at the steps in
    `preempt_at`); return token ids by prompt."""
    arrivals = dict(arrivals or {})
    ids = {llm.add_request(prompt, params): prompt for prompt in prompts}
    pools = [llm.runner.blocks] + [drafter.proposer.runner.blocks for method, drafter in llm.engine.drafters.items()
                                   if method == "draft"]
    free_at_start = [pool.num_free_blocks for pool in pools]
    outputs, step = {}, 0
    while llm.has_unfinished_requests() or arrivals:
        for prompt in arrivals.pop(step, []):
            ids[llm.add_request(prompt, params)] = prompt
        for output in llm.step():
            if output.finished:
                outputs[ids[output.request_id]] = output
        for pool in pools:
            pool.check_invariants()
        if step in preempt_at and len(llm.engine.scheduler.running) > 1:
            llm.engine.scheduler.preempt(llm.engine.scheduler.running[-1])
        step += 1
    assert [pool.num_free_blocks for pool in pools] == free_at_start  # nothing leaked
    return {prompt: output.token_ids for prompt, output in outputs.items()}, outputs


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("batch_size", [1, 2, 3, 8, 16])
def test_batched_output_equals_solo_output(drafter, batch_size, tiny_qwen, random_draft, solo_outputs):
    llm = build(tiny_qwen, random_draft, drafter, max_num_seqs=batch_size)
    prompts = PROMPTS[:max(batch_size, 4)]
    outputs = llm.generate(prompts, GREEDY)
    assert {p: o.token_ids for p, o in zip(prompts, outputs)} == {p: solo_outputs[p] for p in prompts}
    assert_drafted_as_expected(drafter, outputs)


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_requests_arriving_while_others_run(drafter, tiny_qwen, random_draft, solo_outputs, drafting_pays):
    llm = build(tiny_qwen, random_draft, drafter, adaptive=True, max_num_seqs=6)
    got, outputs = run_checking_blocks(llm, PROMPTS[:4], GREEDY, arrivals={2: PROMPTS[4:7], 9: PROMPTS[7:12]})
    assert got == {p: solo_outputs[p] for p in PROMPTS[:12]}
    assert_drafted_as_expected(drafter, outputs.values())


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_forced_preemption_loses_nothing(drafter, tiny_qwen, random_draft, solo_outputs):
    """A cache of 24 blocks of 8 tokens cannot hold 8 requests needing 78 blocks in all: requests
    wait, running ones are preempted (when blocks run short, and forced at a few steps) and resume,
    and every output is unchanged."""
    bytes_per_token = ModelRunner.kv_bytes_per_token(LLM(str(tiny_qwen), max_model_len=256, progress=False).model)
    llm = build(tiny_qwen, random_draft, drafter, max_num_seqs=8, block_size=8,
                kv_cache_memory_bytes=24 * 8 * bytes_per_token)
    assert llm.runner.blocks.num_blocks == 24
    prompts = PROMPTS[:8]
    got, outputs = run_checking_blocks(llm, prompts, GREEDY, preempt_at=(3, 6, 10, 15))
    assert got == {p: solo_outputs[p] for p in prompts}
    assert sum(o.metrics.num_preemptions for o in outputs.values()) >= 2
    assert_drafted_as_expected(drafter, outputs.values())


def test_memory_budget_makes_requests_wait_then_complete(tiny_qwen, solo_outputs):
    bytes_per_token = ModelRunner.kv_bytes_per_token(LLM(str(tiny_qwen), max_model_len=256, progress=False).model)
    llm = LLM(str(tiny_qwen), max_model_len=256, progress=False, max_num_seqs=16, block_size=8,
              kv_cache_memory_bytes=30 * 8 * bytes_per_token)
    for prompt in PROMPTS:
        llm.add_request(prompt, GREEDY)
    most_running, done = 0, {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                done[output.prompt] = output.token_ids
        most_running = max(most_running, len(llm.engine.scheduler.running))
    assert 1 < most_running < len(PROMPTS)  # batched, but never all at once: the rest waited
    assert done == {p: solo_outputs[p] for p in PROMPTS}


def test_a_request_that_can_never_fit_is_refused_and_nothing_is_queued(tiny_qwen):
    bytes_per_token = ModelRunner.kv_bytes_per_token(LLM(str(tiny_qwen), max_model_len=256, progress=False).model)
    llm = LLM(str(tiny_qwen), max_model_len=256, progress=False, block_size=8,
              kv_cache_memory_bytes=4 * 8 * bytes_per_token)
    with pytest.raises(PromptTooLongError, match=r"needs \d+ KV blocks of 8 tokens, but the whole cache has 4"):
        llm.generate(["short", "x " * 40], SamplingParams(temperature=0, max_tokens=10))
    assert not llm.engine.has_unfinished()
    assert len(llm.generate("short", SamplingParams(temperature=0, max_tokens=10))[0].token_ids) == 10


class MixedProposer:
    """Proposes the true greedy continuation for some requests (all accepted) and a wrong one for
    the others (none accepted), so one batch holds rows accepting everything and nothing."""

    def __init__(self, reference, vocab_size):
        self.reference, self.vocab_size = reference, vocab_size

    def propose(self, seqs, num_tokens):
        drafts = []
        for seq, k in zip(seqs, num_tokens):
            truth = self.reference[seq.prompt][len(seq.output_ids):][:k]
            good = len(seq.prompt) % 2 == 0
            drafts.append(Draft(truth if good else [(t + 1) % self.vocab_size for t in truth]))
        return drafts

    def on_verified(self, seqs, num_accepted):
        pass

    def release(self, seq):
        pass

    def lag(self, seq):
        return 0


def test_rows_accepting_everything_and_nothing_share_a_batch(tiny_qwen, solo_outputs):
    llm = LLM(str(tiny_qwen), max_model_len=256, progress=False, max_num_seqs=16)
    llm.engine.add_drafter("mixed", Drafter(MixedProposer(solo_outputs, llm.tokenizer.vocab_size), FixedLength(4), 4))
    llm.engine.default_method = "mixed"
    got = {o.prompt: o for o in llm.generate(PROMPTS, GREEDY)}
    assert {p: o.token_ids for p, o in got.items()} == {p: solo_outputs[p] for p in PROMPTS}
    rates = {len(p) % 2 == 0: [] for p in PROMPTS}
    for prompt, output in got.items():
        spec = output.metrics.spec
        if spec.num_draft_tokens:
            rates[len(prompt) % 2 == 0].append(spec.num_accepted_tokens / spec.num_draft_tokens)
    assert min(rates[True]) == 1.0 and max(rates[False]) == 0.0


def test_rows_of_different_drafters_and_plain_rows_share_a_batch(tiny_qwen, random_draft, solo_outputs,
                                                                 drafting_pays):
    """Per-request speculation: the LLM's drafter, none, prompt lookup with k <= 2, and layer skip
    (built on first use), all in one running batch."""
    llm = build(tiny_qwen, random_draft, "draft=target", max_num_seqs=8)
    choices = [None, {"enabled": False}, {"method": "ngram", "num_speculative_tokens": 2}, {"method": "layer_skip"}]
    ids = {llm.add_request(prompt, GREEDY, speculative=choices[i % 4]): (prompt, i % 4)
           for i, prompt in enumerate(PROMPTS[:8])}
    outputs = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                outputs[output.request_id] = output
    assert {ids[r][0]: o.token_ids for r, o in outputs.items()} == {p: solo_outputs[p] for p in PROMPTS[:8]}
    assert set(llm.engine.drafters) == {"draft", "ngram", "layer_skip"}  # (built adaptive, on DRAFTING_PAYS)
    by_kind = {kind: [o for r, o in outputs.items() if ids[r][1] == kind] for kind in range(4)}
    for output in by_kind[0]:
        assert output.metrics.spec.mean_acceptance_length > 1  # the target as its own draft
    for output in by_kind[1]:
        assert output.metrics.spec.num_drafts == 0 and output.metrics.spec.num_plain_steps == 0
    assert_drafted(by_kind[2], accepted=False)  # prompt lookup, never right on tiny_qwen
    assert all(len(o.metrics.spec.drafted_per_position) <= 2 for o in by_kind[2])
    assert_drafted(by_kind[3])  # layer skip
    with pytest.raises(Exception, match="loads a model of its own"):
        build(tiny_qwen, random_draft, "plain").add_request("hi", GREEDY, speculative={"method": "draft"})


@pytest.mark.parametrize("step_mode", ["auto", "eager"])
@pytest.mark.parametrize("quantization", ["int4", "none"])
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_the_target_drafting_for_itself_accepts_everything_at_any_row_count(tiny_qwen, rows, quantization, step_mode):
    """The direct test of batch invariance: verifying k tokens for R rows computes, bit for bit,
    what R rows of one-token steps compute, and a draft model's catch-up over a whole prompt what
    the target's prefill computed; so a target drafting for itself (k = 4, greedy) has every draft
    accepted and equals plain decoding, at 1, 8 and 32 rows alike. With step_mode "eager" the
    speculative run's passes go through the static-shape step (padded buckets) while plain
    decoding takes the eager path: they must still agree bit for bit."""
    prompts = [PROMPTS[i % len(PROMPTS)] + " x" * (i // len(PROMPTS)) for i in range(rows)]  # 1 to ~100 tokens
    assert rows < 8 or max(len(Tokenizer(tiny_qwen).encode(p)) for p in prompts) > 64  # long catch-ups too
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=rows, progress=False, quantization=quantization)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=rows, progress=False, quantization=quantization,
              step_mode=step_mode,
              speculative={"method": "draft", "model": str(tiny_qwen), "num_speculative_tokens": 4, "adaptive": False,
                           "quantization": quantization, "draft_vocab_size": None, "draft_context_window": None})
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    metrics = llm.spec_metrics
    assert metrics.num_draft_tokens >= rows * 3 and metrics.num_accepted_tokens == metrics.num_draft_tokens
    assert (step_mode == "eager") == bool(llm.runner.static_step and llm.runner.static_step._seen)


def test_a_request_is_admitted_only_beside_what_the_running_ones_next_step_takes():
    """A running request drafting 8 tokens a step in blocks of 4 takes up to 3 blocks a step: a new
    request is admitted only if the blocks left hold its own step beside that (with one block of
    headroom per running request it was admitted, preempted at the next step, admitted again...)."""
    from types import SimpleNamespace

    from draftwise.cache.block_manager import BlockManager
    from draftwise.engine.scheduler import Scheduler

    def request(row=None):
        return SimpleNamespace(token_ids=[1, 2, 3, 4], prompt_token_ids=[1, 2, 3, 4], num_tokens_left=20, row=row,
                               metrics=SimpleNamespace(num_preemptions=0))

    def scheduler_over(num_blocks: int) -> Scheduler:
        blocks = BlockManager(num_blocks, block_size=4)
        scheduler = Scheduler(blocks, max_num_seqs=4, step_tokens=lambda seq: 9, release=lambda seq: None)
        blocks.add(0)
        blocks.grow(0, 4)
        scheduler.running.append(request(row=0))  # holds 1 block, its next step takes 3 more
        scheduler.add(request())  # its prefill and first step: blocks_for(4 + 9) = 4
        return scheduler

    assert not scheduler_over(7).schedule().is_prefill  # 6 free < 3 + 4: it waits
    assert scheduler_over(8).schedule().is_prefill  # 7 free: it fits
