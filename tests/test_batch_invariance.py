"""Batch invariance, bit for bit, on the logits: a row's logits do not depend on how it was fed (its
prompt alone or in a padded batch of rows; its next tokens one at a time or k at a time) nor on the
rows beside it. Greedy speculation is then identical to plain decoding without relying on the
absence of near-ties (the tiny test models rarely have them, so token-level tests alone cannot see
a rounding difference; these can)."""

import pytest
import torch

from draftwise import LLM

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. " * 6, "x", "for i in range(10):\n" * 9,
           "import numpy as np\n" * 4]
NEXT = 6  # tokens fed after each prompt


@pytest.fixture(scope="module", params=["int4", "none"])
def llm(request, tiny_qwen):
    return LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False, quantization=request.param)


def one_at_a_time(llm, prompt_ids, next_ids):
    """Logits [NEXT, V] of each next token, the prompt fed alone and then one token per pass."""
    runner = llm.runner
    row = runner.allocate()
    try:
        runner.forward([row], [prompt_ids], [1])
        return torch.cat([runner.forward([row], [[token]], [1]).logits for token in next_ids])
    finally:
        runner.free(row)


def all_together(llm, prompt_ids, next_ids, window):
    """The same logits with every prompt in one padded pass and the next tokens `window` at a time,
    every row in each pass."""
    runner = llm.runner
    rows = [runner.allocate() for _ in prompt_ids]
    try:
        runner.forward(rows, prompt_ids, [1] * len(rows))
        logits = [[] for _ in rows]
        for start in range(0, NEXT, window):
            chunk = [ids[start:start + window] for ids in next_ids]
            result = runner.forward(rows, chunk, [len(c) for c in chunk])
            for b in range(len(rows)):
                logits[b].append(result.logits[result.cu_num_logits[b]:result.cu_num_logits[b + 1]])
        return [torch.cat(row_logits) for row_logits in logits]
    finally:
        for row in rows:
            runner.free(row)


@pytest.mark.parametrize("window", [2, 3, 6])
def test_logits_do_not_depend_on_how_a_row_is_fed_or_what_shares_its_pass(llm, window):
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert max(map(len, prompt_ids)) > 64  # prefill past the per-query limit of the fallback path
    next_ids = [[(7 * b + 11 * i) % 300 + 5 for i in range(NEXT)] for b in range(len(PROMPTS))]
    alone = [one_at_a_time(llm, p, n) for p, n in zip(prompt_ids, next_ids)]
    together = all_together(llm, prompt_ids, next_ids, window)
    for b, (a, t) in enumerate(zip(alone, together)):
        assert torch.equal(a, t), f"row {b}: max |diff| {(a - t).abs().max().item():.3g}"


def test_rows_of_different_widths_in_one_pass_compute_their_own_tokens_only(llm):
    """A ragged pass (one row verifying several drafts beside rows taking one token) is packed: it
    computes sum(widths) tokens, not rows x the widest, and each row's logits are still bit for bit
    those of its tokens fed one at a time."""
    runner = llm.runner
    assert runner.packs_rows  # (the CPU's native attention kernel)
    assert runner.pass_tokens([6, 1, 1, 2]) == 10
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    next_ids = [[(5 * b + 13 * i) % 300 + 5 for i in range(NEXT)] for b in range(len(PROMPTS))]
    alone = [one_at_a_time(llm, p, n) for p, n in zip(prompt_ids, next_ids)]
    widths = [NEXT, 1, 2, 3, 1]  # row b takes its next tokens widths[b] at a time
    rows = [runner.allocate() for _ in prompt_ids]
    try:
        runner.forward(rows, prompt_ids, [1] * len(rows))
        fed = [0] * len(rows)
        logits = [[] for _ in rows]
        while any(f < NEXT for f in fed):
            active = [b for b in range(len(rows)) if fed[b] < NEXT]
            chunks = [next_ids[b][fed[b]:fed[b] + widths[b]] for b in active]
            result = runner.forward([rows[b] for b in active], chunks, [len(c) for c in chunks])
            for j, b in enumerate(active):
                logits[b].append(result.logits[result.cu_num_logits[j]:result.cu_num_logits[j + 1]])
                fed[b] += len(chunks[j])
    finally:
        for row in rows:
            runner.free(row)
    for b, a in enumerate(alone):
        together = torch.cat(logits[b])
        assert torch.equal(a, together), f"row {b}: max |diff| {(a - together).abs().max().item():.3g}"
