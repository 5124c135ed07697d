"""Paged key/value storage: token slots in fixed-size blocks, shared by all sequences.

`keys` and `values` are [L, num_slots, Hkv, D] with num_slots = num_blocks * block_size; the
`BlockManager` says which slots a sequence's positions occupy. Writes go to explicit slots;
rollback (`truncate`) is bookkeeping only: entries past a sequence's length are never read (a
query at position p attends to keys at positions <= p), and the blocks past it return to the pool.
Nothing is copied to realign rows. Attention reads keys in place through each row's slot table
(the native backend), or from a gather into [B, Hkv, T, D] (a slice of the storage for a single
sequence whose blocks are consecutive); `attention_backend.py` says which and why.
"""

from __future__ import annotations

import torch

from draftwise.cache import attention_backend
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
        self._kernel = attention_backend.kernel_for(torch.device(device), cache.keys.dtype, cache.keys.shape[-1])
        if self._kernel is not None:
            self._key_slots = _slot_table(blocks, handles, kv_length, device)  # [B, T]
            self._query_rows = torch.arange(len(handles), device=device).repeat_interleave(len(host_positions[0]))
            self._positions = torch.tensor(host_positions, device=device).flatten()  # [B*S]
            return
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

    def attend(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Attention of the pass's queries q [B, Hq, S, D] (at positions [B, S]) over this layer's
        keys and values (written already), causal: [B, Hq, S, D]."""
        if self._kernel is not None:
            return attention_backend.kernel_attention(self._kernel, q, self.cache.keys[layer], self.cache.values[layer],
                                                      self._key_slots, self._query_rows, self._positions)
        k, v = self.read(layer, self._kv_length)  # [B, Hkv, T, D]
        if q.shape[2] <= attention_backend.PER_QUERY_MAX:
            return attention_backend.per_query_attention(q, k, v, self.host_positions)
        return attention_backend.masked_attention(q, k, v, positions)

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, length, D] of this view's rows."""
        if length != self._kv_length:
            raise ValueError(f"this view reads {self._kv_length} positions, not {length}")
        if self._slice is not None:
            return (self.cache.keys[layer, self._slice].unsqueeze(0).transpose(1, 2),
                    self.cache.values[layer, self._slice].unsqueeze(0).transpose(1, 2))
        return (self.cache.keys[layer][self._read_slots].transpose(1, 2),  # [B, T, Hkv, D] -> [B, Hkv, T, D]
                self.cache.values[layer][self._read_slots].transpose(1, 2))


def _slot_table(blocks: BlockManager, handles: list[int], length: int, device: torch.device) -> torch.Tensor:
    """[B, length] the slot of each position of each row (positions past a row's blocks: block 0's
    slots, never attended)."""
    size = blocks.block_size
    count = blocks.blocks_for(length)
    tables = [blocks.tables[handle][:count] for handle in handles]
    table = torch.tensor([t + [0] * (count - len(t)) for t in tables], dtype=torch.long)  # [B, blocks]
    slots = (table[:, :, None] * size + torch.arange(size)).reshape(len(handles), count * size)[:, :length]
    return slots.contiguous().to(device)
