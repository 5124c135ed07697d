"""The block manager's bookkeeping: paired verbs, invariants after every operation, no leaks."""

import random

import pytest

from draftwise.cache.block_manager import BlockManager
from draftwise.errors import KVCacheFullError


def test_grow_truncate_free_and_addressing():
    blocks = BlockManager(num_blocks=6, block_size=4)
    blocks.add(0)
    assert blocks.can_grow(0, 24) and not blocks.can_grow(0, 25)
    blocks.grow(0, 9)
    blocks.set_length(0, 9)
    assert blocks.tables[0] == [0, 1, 2] and blocks.num_free_blocks == 3
    assert blocks.slot(0, 5) == 1 * 4 + 1 and blocks.contiguous_start(0, 9) == 0
    blocks.truncate(0, 4)  # the tokens of the third block were rejected
    assert blocks.tables[0] == [0] and blocks.num_free_blocks == 5
    with pytest.raises(ValueError):
        blocks.truncate(0, 5)  # cannot truncate to more than it holds
    blocks.free(0)
    assert blocks.num_free_blocks == 6
    blocks.check_invariants()


def test_running_out_raises_and_changes_nothing():
    blocks = BlockManager(num_blocks=2, block_size=4)
    blocks.add(0)
    with pytest.raises(KVCacheFullError, match="needs 3 more blocks of 4 tokens but 2 of 2 are free"):
        blocks.grow(0, 12)
    assert blocks.num_free_blocks == 2 and blocks.tables[0] == []


def test_random_workload_keeps_invariants_and_leaks_nothing():
    rng = random.Random(0)
    blocks = BlockManager(num_blocks=40, block_size=4)
    live: list[int] = []
    for handle in range(2000):
        action = rng.random()
        if action < 0.3 or not live:
            blocks.add(handle)
            live.append(handle)
        elif action < 0.7:
            seq = rng.choice(live)
            length = blocks.lengths[seq] + rng.randint(1, 9)
            if blocks.can_grow(seq, length):
                blocks.grow(seq, length)
                blocks.set_length(seq, length)
            else:
                with pytest.raises(KVCacheFullError):
                    blocks.grow(seq, length)
        elif action < 0.9:
            seq = rng.choice(live)
            blocks.truncate(seq, rng.randint(0, blocks.lengths[seq]))
        else:
            seq = live.pop(rng.randrange(len(live)))
            blocks.free(seq)
        blocks.check_invariants()
    for seq in live:
        blocks.free(seq)
    assert blocks.num_free_blocks == 40 and not blocks.tables
