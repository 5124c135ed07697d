"""Which KV blocks each sequence holds: allocate, grow, truncate, free; and which full blocks of
committed tokens other sequences may share (automatic prefix caching).

The cache is one pool of `num_blocks` blocks of `block_size` token slots. A sequence owns a block
table (its blocks in order); token position p lives in slot table[p // block_size] * block_size +
p % block_size. Growing a sequence takes blocks from the free pool, truncating it (a rejected
draft rolled back) returns the blocks past its new length, freeing it returns them all. Free
blocks are handed out lowest first, so a sequence running alone gets consecutive blocks and its
keys can be read as one slice, without a gather.

Prefix caching (vLLM's automatic prefix caching). A block all of whose tokens are committed is
registered under the hash of its tokens and of every token before it (a chain of BLAKE2b digests),
so its keys and values are a function of that hash alone (the kernels compute a position the same
whatever else shares its pass). A new sequence starts with the longest run of registered blocks
its tokens hash to (`share_prefix`), each block counted once more, and computes only the rest. A
block nobody holds any more keeps its keys while it is free: it waits, least recently released
first, until a growth needs a block and the unregistered ones have run out. A registered block is
never written again: its holders only append past it, and truncation never cuts into committed
tokens (the engine rolls back drafts only).

A chain's root is the sequence's `salt` (vLLM's `cache_salt`; b"": the shared root): sequences
with different salts never share a block, so one tenant cannot learn from a faster first token that
another sent the same prefix (`prefix_salt`).
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict

import numpy as np

from draftwise.errors import KVCacheFullError


def prefix_salt(*labels: str | None) -> bytes:
    """The root of a sequence's prefix-hash chain from labels that partition the cache (its tenant,
    its cache_salt): b"" when none is set, so unlabelled sequences share as before."""
    if all(label is None for label in labels):
        return b""
    named = "\0".join("-" if label is None else "+" + label for label in labels)
    return hashlib.blake2b(named.encode("utf-8", "surrogatepass"), digest_size=16, person=b"draftwise-salt").digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free = list(range(num_blocks))  # a heap: lowest block first (holding no registered prefix)
        self._cached: OrderedDict[int, None] = OrderedDict()  # free blocks holding a registered prefix, LRU first
        self.refs = [0] * num_blocks  # holders of each block
        self._hash_of: dict[int, bytes] = {}  # registered block -> the hash of its prefix
        self._block_of: dict[bytes, int] = {}  # prefix hash -> its registered block
        self._registered: dict[int, tuple[int, bytes]] = {}  # handle -> (its blocks hashed so far, the last hash)
        self.tables: dict[int, list[int]] = {}  # sequence handle -> its blocks, in position order
        self.lengths: dict[int, int] = {}  # sequence handle -> tokens it holds
        self.prefix_queries = 0  # tokens looked up in the prefix cache (vLLM's prefix_cache_queries)
        self.prefix_hits = 0  # of them, found (vLLM's prefix_cache_hits)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a growth can take: free ones, and idle ones holding a cached prefix (evicted then)."""
        return len(self._free) + len(self._cached)

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
        return self.blocks_for(length) - len(self.tables[handle]) <= self.num_free_blocks

    def grow(self, handle: int, length: int) -> None:
        """Hold enough blocks for `length` tokens (the length itself is set by `set_length`)."""
        table = self.tables[handle]
        missing = self.blocks_for(length) - len(table)
        if missing > self.num_free_blocks:
            raise KVCacheFullError(
                f"the KV cache needs {missing} more blocks of {self.block_size} tokens but {self.num_free_blocks} "
                f"of {self.num_blocks} are free")
        for _ in range(missing):
            block = self._take()
            self.refs[block] = 1
            table.append(block)

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
        if length % self.block_size and table[keep - 1] in self._hash_of:
            # (the block the sequence will write into again: cutting into committed tokens, which the
            # engine never does but to restart a sequence from nothing)
            raise ValueError(f"sequence {handle} cannot cut into its registered block {table[keep - 1]}")
        for block in table[keep:]:
            self._release(block)
        del table[keep:]
        if self._registered.get(handle, (0, b""))[0] > keep:
            del self._registered[handle]  # (hashed again from the start at the next `register`)

    def free(self, handle: int) -> None:
        for block in self.tables.pop(handle):
            self._release(block)
        del self.lengths[handle]
        self._registered.pop(handle, None)

    # --- prefix caching ---------------------------------------------------------------------
    def share_prefix(self, handle: int, token_ids: list[int], salt: bytes = b"") -> int:
        """An empty sequence about to hold `token_ids` starts with the longest run of cached blocks
        they hash to from `salt` (at most all but the last token: its logits are what the pass is
        for); returns the tokens it now holds."""
        if not self.prefix_caching or self.tables[handle]:
            return 0
        self.prefix_queries += len(token_ids)
        table, last = self.tables[handle], salt
        for index in range((len(token_ids) - 1) // self.block_size):
            digest = self._hash(last, token_ids, index)
            block = self._block_of.get(digest)
            if block is None:
                break
            if self.refs[block] == 0:
                del self._cached[block]
            self.refs[block] += 1
            table.append(block)
            last = digest
        self.lengths[handle] = len(table) * self.block_size
        self._registered[handle] = (len(table), last)
        self.prefix_hits += self.lengths[handle]
        return self.lengths[handle]

    def prefix_digests(self, token_ids: list[int], salt: bytes = b"") -> list[bytes]:
        """The hashes `share_prefix` looks up for a sequence about to hold `token_ids`, in order."""
        digests, last = [], salt
        for index in range((len(token_ids) - 1) // self.block_size if self.prefix_caching else 0):
            last = self._hash(last, token_ids, index)
            digests.append(last)
        return digests

    def cached_prefix_length(self, digests: list[bytes]) -> int:
        """The tokens `share_prefix` would give now the sequence whose `prefix_digests` these are."""
        found = 0
        while found < len(digests) and digests[found] in self._block_of:
            found += 1
        return found * self.block_size

    def reset_prefix_cache(self) -> None:
        """Nothing cached is found again: idle cached blocks return to the free pool and no block
        keeps its hash (sequences running keep their blocks; what they commit later is registered
        as before)."""
        for block in self._cached:
            heapq.heappush(self._free, block)
        self._cached.clear()
        self._hash_of.clear()
        self._block_of.clear()

    def register(self, handle: int, token_ids: list[int], salt: bytes = b"") -> None:
        """The sequence's full blocks of committed tokens (token_ids, of which it holds the first
        `lengths[handle]`) become findable by `share_prefix` with the same `salt`."""
        if not self.prefix_caching:
            return
        done, last = self._registered.get(handle, (0, salt))
        table = self.tables[handle]
        for index in range(done, min(self.lengths[handle], len(token_ids)) // self.block_size):
            digest = self._hash(last, token_ids, index)
            block = table[index]
            if block not in self._hash_of and digest not in self._block_of:
                self._hash_of[block] = digest
                self._block_of[digest] = block
            done, last = index + 1, digest
        self._registered[handle] = (done, last)

    def _hash(self, parent: bytes, token_ids: list[int], index: int) -> bytes:
        tokens = np.asarray(token_ids[index * self.block_size:(index + 1) * self.block_size], dtype=np.int64)
        return hashlib.blake2b(parent + tokens.tobytes(), digest_size=16).digest()

    def _take(self) -> int:
        """A block for a growth: a free one, else the least recently released cached one (evicted)."""
        if self._free:
            return heapq.heappop(self._free)
        block, _ = self._cached.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        return block

    def _release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self._hash_of:
                self._cached[block] = None  # (most recently released last)
            else:
                heapq.heappush(self._free, block)

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
        """Every block is free, cached or held, and held as often as its count says; every table
        covers its length; registered hashes and blocks map one to one."""
        held: dict[int, int] = {}
        for table in self.tables.values():
            for block in table:
                held[block] = held.get(block, 0) + 1
        idle = set(self._free) | set(self._cached)
        assert not set(held) & idle, "a held block is also free"
        assert len(held) + len(idle) == self.num_blocks and len(self._free) + len(self._cached) == len(idle), \
            "blocks were lost"
        assert all(self.refs[block] == count for block, count in held.items()), "a block's count is wrong"
        assert all(self.refs[block] == 0 for block in idle), "an idle block is counted as held"
        assert set(self._cached) <= set(self._hash_of), "a cached block holds no prefix"
        assert all(self._block_of[digest] == block for block, digest in self._hash_of.items()), "hashes disagree"
        for handle, table in self.tables.items():
            assert len(table) >= self.blocks_for(self.lengths[handle]), f"sequence {handle} holds too few blocks"
