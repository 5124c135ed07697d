"""The masks of a constrained step, applied as a bias looked up byte by byte, give exactly the logits
of the bits read one by one and filled with -inf; the dead positions read from each row's maximum are
those where every logit is -inf."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from draftwise.engine.constrained import DeadPositions, PendingMasks
from draftwise.structured.masks import allowed_tokens


def pending(rows: list[int], width: int, bitmask: torch.Tensor, vocab: int) -> PendingMasks:
    masks = object.__new__(PendingMasks)
    masks.rows, masks.width, masks.vocab_size = rows, width, vocab
    masks._future = Future()
    masks._future.set_result(bitmask)
    return masks


@pytest.mark.parametrize("batch, rows, width, positions, vocab", [
    (1, [0], 4, 4, 151936),  # one row, every position masked
    (3, [0, 2], 5, 3, 1000),  # a pass narrower than the masks; the middle row free
    (4, [1], 1, 1, 100),  # a plain step; a vocabulary that is not a multiple of 32
])
def test_the_byte_table_masks_as_the_bits_read_one_by_one_do(batch, rows, width, positions, vocab):
    generator = torch.Generator().manual_seed(batch * 31 + width)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows) * width, words), dtype=torch.int32, generator=generator)
    bitmask[0] = 0  # (a position where nothing is allowed)
    logits = torch.randn(batch, positions, vocab, generator=generator)
    before = logits.clone()
    masks = pending(rows, width, bitmask, vocab)
    fast = masks.apply(logits)
    reference = logits.clone()
    for r, b in enumerate(rows):
        for i in range(min(width, positions)):
            word = bitmask[r * width + i].tolist()
            refused = [t for t in range(vocab) if not (word[t // 32] >> (t % 32)) & 1]
            reference[b, i, refused] = float("-inf")
    assert torch.equal(fast, reference) and torch.equal(logits, before)  # (the pass's own logits untouched)
    assert torch.equal(~torch.isinf(fast[rows[-1], 0]), allowed_tokens(bitmask[(len(rows) - 1) * width:][:1], vocab)[0])
    assert torch.isinf(fast[rows[0], 0]).all()
    free = [b for b in range(batch) if b not in rows]
    assert all(torch.equal(fast[b], logits[b]) for b in free)
    refused = (fast == float("-inf")).sum().item()
    assert refused > (bitmask == 0).sum().item()  # (random bits refuse about half of the rest too)


def test_dead_positions_are_where_every_token_of_a_constrained_row_is_refused():
    logits = torch.randn(3, 4, 50)
    logits[0, 2] = float("-inf")  # row 0: nothing at position 2 (and at 3)
    logits[0, 3] = float("-inf")
    logits[1, 0] = float("-inf")  # row 1 is free: never asked about
    logits[2, 1, :49] = float("-inf")  # row 2: one token left at position 1
    batch = [SimpleNamespace(grammar=object(), params=SimpleNamespace(allowed_token_ids=None)),
             SimpleNamespace(grammar=None, params=SimpleNamespace(allowed_token_ids=None)),
             SimpleNamespace(grammar=None, params=SimpleNamespace(allowed_token_ids=[3]))]
    dead = DeadPositions(batch, logits)
    assert (dead.get(0), dead.get(1), dead.get(2)) == (2, None, None)
