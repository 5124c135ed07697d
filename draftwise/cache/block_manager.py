"""Which KV blocks each sequence holds: allocate, grow, truncate, free.

The cache is one pool of `num_blocks` blocks of `block_size` token slots. A sequence owns a block
table (its blocks in order); token position p lives in slot table[p // block_size] * block_size +
p % block_size. Growing a sequence takes blocks from the free pool, truncating it (a rejected
draft rolled back) returns the blocks past its new length, freeing it returns them all. Free
blocks are handed out lowest first, so a sequence running alone gets consecutive blocks and its
keys can be read as one slice, without a gather.
"""

from __future__ import annotations

import heapq

from draftwise.errors import KVCacheFullError


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks))  # a heap: lowest block first
        self.tables: dict[int, list[int]] = {}  # sequence handle -> its blocks, in position order
        self.lengths: dict[int, int] = {}  # sequence handle -> tokens it holds

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- paired verbs -----------------------------------------------------------------------
    def add(self, handle: int) -> None:
        """Start an empty sequence (it holds no block until it grows)."""
        if handle in self.tables:
            raise ValueError(f"sequence {handle} already holds a block table")
        self.tables[handle] = []
        self.lengths[handle] = 0

    def can_grow(self, handle: int, length: int) -> bool:
        return self.blocks_for(length) - len(self.tables[handle]) <= len(self._free)

    def grow(self, handle: int, length: int) -> None:
        """Hold enough blocks for `length` tokens (the length itself is set by `set_length`)."""
        table = self.tables[handle]
        missing = self.blocks_for(length) - len(table)
        if missing > len(self._free):
            raise KVCacheFullError(
                f"the KV cache needs {missing} more blocks of {self.block_size} tokens but {len(self._free)} "
                f"of {self.num_blocks} are free")
        table.extend(heapq.heappop(self._free) for _ in range(missing))

    def set_length(self, handle: int, length: int) -> None:
        if length > len(self.tables[handle]) * self.block_size:
            raise ValueError(f"sequence {handle} holds blocks for fewer than {length} tokens")
        self.lengths[handle] = length

    def truncate(self, handle: int, length: int) -> None:
        """Keep the first `length` tokens; blocks past them go back to the pool."""
        if not 0 <= length <= self.lengths[handle]:
            raise ValueError(f"cannot truncate sequence {handle} of length {self.lengths[handle]} to {length}")
        self.lengths[handle] = length
        table = self.tables[handle]
        keep = self.blocks_for(length)
        for block in table[keep:]:
            heapq.heappush(self._free, block)
        del table[keep:]

    def free(self, handle: int) -> None:
        for block in self.tables.pop(handle):
            heapq.heappush(self._free, block)
        del self.lengths[handle]

    # --- addressing -------------------------------------------------------------------------
    def slot(self, handle: int, position: int) -> int:
        table = self.tables[handle]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def contiguous_start(self, handle: int, length: int) -> int | None:
        """The first slot if positions 0..length-1 lie in consecutive blocks, else None."""
        table = self.tables[handle][:self.blocks_for(length)]
        if not table or table[-1] - table[0] != len(table) - 1 or table != list(range(table[0], table[-1] + 1)):
            return None
        return table[0] * self.block_size

    def check_invariants(self) -> None:
        """Every block is free or held by exactly one sequence; every table covers its length."""
        held = [block for table in self.tables.values() for block in table]
        assert len(held) == len(set(held)), "a block is held twice"
        assert not set(held) & set(self._free), "a held block is also free"
        assert len(held) + len(self._free) == self.num_blocks, "blocks were lost"
        for handle, table in self.tables.items():
            assert len(table) >= self.blocks_for(self.lengths[handle]), f"sequence {handle} holds too few blocks"
