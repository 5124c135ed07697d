"""Paged key/value storage: token slots in fixed-size blocks, shared by all sequences.

`keys` and `values` are [L, num_slots, Hkv, D] with num_slots = num_blocks * block_size; the
`BlockManager` says which slots a sequence's positions occupy. Writes go to explicit slots;
rollback (`truncate`) is bookkeeping only: entries past a sequence's length are never read (a
query at position p attends to keys at positions <= p), and the blocks past it return to the pool.
Nothing is copied to realign rows. A read gathers a sequence's slots into [B, Hkv, T, D], except
for a single sequence whose blocks are consecutive: that is a slice of the storage.
"""

from __future__ import annotations

import torch

from draftwise.cache.block_manager import BlockManager


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, Hkv, D]
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, Hkv, D]
        self.blocks = BlockManager(num_blocks, block_size)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    def view(self, handles: list[int], host_positions: list[list[int]], valid: torch.Tensor | None,
             host_valid: list[list[bool]] | None, kv_length: int) -> "KVCacheView":
        return KVCacheView(self, handles, host_positions, valid, host_valid, kv_length)


class KVCacheView:
    """The sequences one forward pass writes and reads, in batch order.

    host_positions [B][S] are where each new token goes; valid [B, S] (None: all; host_valid: the
    same on the host) marks real tokens, so that padding of a ragged batch is never written. Reads
    cover positions 0..kv_length-1 of every row (a row's positions past its own length hold stale
    data that no query attends to).
    """

    def __init__(self, cache: KVCache, handles: list[int], host_positions: list[list[int]],
                 valid: torch.Tensor | None, host_valid: list[list[bool]] | None, kv_length: int) -> None:
        self.cache = cache
        self.host_positions = host_positions  # [B][S]
        blocks = cache.blocks
        device = cache.keys.device
        write_slots = [blocks.slot(handle, p) for b, handle in enumerate(handles)
                       for s, p in enumerate(host_positions[b]) if host_valid is None or host_valid[b][s]]
        self._write_slots = torch.tensor(write_slots, device=device)  # [N]
        self._valid = valid
        self._kv_length = kv_length
        start = blocks.contiguous_start(handles[0], kv_length) if len(handles) == 1 else None
        self._slice = None if start is None else slice(start, start + kv_length)
        self._read_slots = None
        if self._slice is None:
            read_slots = []
            for handle in handles:
                held = len(blocks.tables[handle]) * blocks.block_size
                read_slots.append([blocks.slot(handle, p) if p < held else 0 for p in range(kv_length)])
            self._read_slots = torch.tensor(read_slots, device=device)  # [B, T]

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the new keys/values [B, Hkv, S, D] of this view's rows."""
        keys = keys.transpose(1, 2)  # [B, S, Hkv, D]
        values = values.transpose(1, 2)
        if self._valid is not None:
            keys, values = keys[self._valid], values[self._valid]  # [N, Hkv, D]
        else:
            keys, values = keys.flatten(0, 1), values.flatten(0, 1)  # [N, Hkv, D]
        self.cache.keys[layer][self._write_slots] = keys
        self.cache.values[layer][self._write_slots] = values

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, length, D] of this view's rows."""
        if length != self._kv_length:
            raise ValueError(f"this view reads {self._kv_length} positions, not {length}")
        if self._slice is not None:
            return (self.cache.keys[layer, self._slice].unsqueeze(0).transpose(1, 2),
                    self.cache.values[layer, self._slice].unsqueeze(0).transpose(1, 2))
        return (self.cache.keys[layer][self._read_slots].transpose(1, 2),  # [B, T, Hkv, D] -> [B, Hkv, T, D]
                self.cache.values[layer][self._read_slots].transpose(1, 2))
