"""Preallocated key/value cache with one row per sequence and per-row lengths.

Writes go to explicit positions; rollback (`truncate`) is bookkeeping only: entries past a row's
length are never read (a query at position p attends to keys at positions <= p) and are simply
overwritten by the next write. Nothing is copied.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_rows: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_rows, num_kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, R, Hkv, T, D]
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # [L, R, Hkv, T, D]
        self.max_len = max_len
        self.num_rows = num_rows
        self.lengths = [0] * num_rows  # tokens held per row (host-side bookkeeping)

    def view(self, rows: list[int], positions: torch.Tensor, valid: torch.Tensor | None = None,
             host_positions: list[list[int]] | None = None) -> "KVCacheView":
        return KVCacheView(self, rows, positions, valid, host_positions)

    def truncate(self, row: int, length: int) -> None:
        """Roll a row back to its first `length` tokens."""
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"cannot truncate row {row} of length {self.lengths[row]} to {length}")
        self.lengths[row] = length

    def free(self, row: int) -> None:
        self.lengths[row] = 0


class KVCacheView:
    """The rows of a cache that one forward pass writes and reads, in batch order.

    positions [B, S] are where each new token goes; valid [B, S] (None: all) marks real tokens,
    so that padding of a ragged batch is never written.
    """

    def __init__(self, cache: KVCache, rows: list[int], positions: torch.Tensor, valid: torch.Tensor | None,
                 host_positions: list[list[int]] | None = None) -> None:
        self.cache = cache
        self.host_positions = host_positions if host_positions is not None else positions.tolist()  # [B][S]
        device = cache.keys.device
        first = rows[0]
        # Rows first..first+B-1 in order are a slice (a view); anything else needs gathering.
        self._slice = slice(first, first + len(rows)) if rows == list(range(first, first + len(rows))) else None
        self._row_index = torch.tensor(rows, device=device)  # [B]
        row_grid = self._row_index[:, None].expand_as(positions)  # [B, S]
        self._valid = valid
        self._write_rows = row_grid[valid] if valid is not None else row_grid.reshape(-1)  # [N]
        self._write_positions = positions[valid] if valid is not None else positions.reshape(-1)  # [N]

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the new keys/values [B, Hkv, S, D] of this view's rows."""
        keys = keys.transpose(1, 2)  # [B, S, Hkv, D]
        values = values.transpose(1, 2)
        if self._valid is not None:
            keys, values = keys[self._valid], values[self._valid]  # [N, Hkv, D]
        else:
            keys, values = keys.flatten(0, 1), values.flatten(0, 1)  # [N, Hkv, D]
        self.cache.keys[layer][self._write_rows, :, self._write_positions] = keys
        self.cache.values[layer][self._write_rows, :, self._write_positions] = values

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, length, D] of this view's rows."""
        if self._slice is not None:
            return (self.cache.keys[layer, self._slice, :, :length],
                    self.cache.values[layer, self._slice, :, :length])
        return (self.cache.keys[layer, self._row_index, :, :length],
                self.cache.values[layer, self._row_index, :, :length])
