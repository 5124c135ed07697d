"""Paged key/value storage: token slots in fixed-size blocks, shared by all sequences.

`keys` and `values` are [L, num_slots, Hkv, D] with num_slots = (num_blocks + 1) * block_size; the
`BlockManager` says which slots a sequence's positions occupy, and the last block is scratch: the
padding of a ragged batch writes there, so that a pass writes every token it computes with one
`index_copy_` and no mask (shapes fixed by the batch, as a compiled or graph-captured step needs).
Rollback (`truncate`) is bookkeeping only: entries past a sequence's length are never read (a query
at position p attends to keys at positions <= p), and the blocks past it return to the pool. Nothing
is copied to realign rows. Attention reads keys in place through each row's block table (the kernel
backends), or from a gather into [B, Hkv, T, D] (a slice of the storage for a single sequence whose
blocks are consecutive); `attention_backend.py` says which and why.
"""

from __future__ import annotations

import numpy as np
import torch

from draftwise.cache import attention_backend
from draftwise.cache.block_manager import BlockManager
from draftwise.model.native_decoder import KernelPlan


def zeroed_storage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor. On the CPU its pages become resident only when first written: the pool is sized
    for max_num_seqs x max_model_len tokens (1.8 GB of fp32 KV for the 1.5B by default), and
    `torch.zeros` writes every page up front, so a process held all of it from the start whatever it
    served. numpy's zeros come from calloc, which for allocations this large maps fresh pages that
    the kernel zeroes on first touch; torch shares that memory (a dtype numpy lacks, bf16, is viewed
    over integers of its width)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    width = torch.tensor([], dtype=dtype).element_size()
    carrier = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    return torch.from_numpy(np.zeros(shape, dtype=carrier)).view(dtype)


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
        prefix_caching: bool = False,
    ) -> None:
        shape = (num_layers, (num_blocks + 1) * block_size, num_kv_heads, head_dim)
        self.keys = zeroed_storage(shape, dtype, device)  # [L, slots, Hkv, D]
        self.values = zeroed_storage(shape, dtype, device)  # [L, slots, Hkv, D]
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.scratch_slot = num_blocks * block_size  # where padding goes (the extra block, never handed out)
        self.kernel = attention_backend.kernel_for(self.keys.device, dtype, head_dim)  # None: the SDPA paths

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    def view(self, handles: list[int], host_positions: list[list[int]], host_valid: list[list[bool]] | None,
             kv_length: int, host_paths: list[list[list[int]] | None] | None = None) -> "KVCacheView":
        return KVCacheView(self, handles, host_positions, host_valid, kv_length, host_paths)

    def move(self, handle: int, sources: list[int], destination: int) -> None:
        """Every layer's keys and values stored at the sequence's positions `sources` go to its
        positions destination, destination + 1, ... (a tree's committed path into chain order;
        the sources are read before anything is written)."""
        if not sources:
            return
        blocks = self.blocks
        device = self.keys.device
        source_slots = torch.tensor([blocks.slot(handle, p) for p in sources], device=device)
        target_slots = torch.tensor([blocks.slot(handle, destination + i) for i in range(len(sources))], device=device)
        self.keys[:, target_slots] = self.keys[:, source_slots]
        self.values[:, target_slots] = self.values[:, source_slots]


class KVCacheView:
    """The sequences one forward pass writes and reads, in batch order.

    host_positions [B][S_b] are the new tokens' positions. With a kernel backend rows may differ in
    length: the pass's queries are packed row after row (each query names its row), so a ragged batch
    computes its real tokens only. The SDPA paths need one S for every row: a ragged batch comes padded,
    host_valid [B][S] (None: all) marking real tokens (padding writes to the scratch slot). Keys cover
    positions 0..kv_length-1 of every row (a row's positions past its own length hold stale data that no
    query attends to). A row fed a token tree has host_paths[b] (`token_tree.paths`): its tokens are
    stored one after another from host_positions[b][0] on, and token s reads the keys before that, then
    those at host_paths[b][s]; rows without one (None) are chains.
    """

    def __init__(self, cache: KVCache, handles: list[int], host_positions: list[list[int]],
                 host_valid: list[list[bool]] | None, kv_length: int,
                 host_paths: list[list[list[int]] | None] | None = None) -> None:
        self.cache = cache
        self.host_positions = host_positions  # [B][S]
        if host_paths is not None:
            host_paths = [None if row_paths is None else _pad_paths(row_paths, row_positions)
                          for row_paths, row_positions in zip(host_paths, host_positions)]
        self.host_keys = None if host_paths is None else [  # [B][S][keys] per tree row: the stored positions read
            None if row_paths is None else [list(range(row_paths[0][0])) + path for path in row_paths]
            for row_paths in host_paths]
        blocks = cache.blocks
        device = cache.keys.device
        write_slots = [blocks.slot(handle, _stored_position(host_positions[b], host_paths, b, s))
                       if host_valid is None or host_valid[b][s] else cache.scratch_slot
                       for b, handle in enumerate(handles) for s in range(len(host_positions[b]))]
        self._write_slots = torch.tensor(write_slots, device=device)  # [N]: every token of the pass
        self._kv_length = kv_length
        if cache.kernel is not None:
            self._block_tables = _block_table(blocks, handles, kv_length, device)  # [B, W]
            row_lengths = torch.tensor([len(row) for row in host_positions], device=device)
            self._query_rows = torch.arange(len(handles), device=device).repeat_interleave(row_lengths)  # [N]
            self._positions = torch.tensor([p for row in host_positions for p in row], device=device)  # [N]
            self._path_start, self._path = (None, None) if host_paths is None else \
                kernel_paths(host_positions, host_paths, device)
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
        """Store the new keys/values [B, Hkv, S, D] of this view's rows (padding: the scratch slot)."""
        write_kv(self.cache.keys[layer], self.cache.values[layer], self._write_slots, keys, values)

    def attend(self, layer: int, q: torch.Tensor, positions: torch.Tensor, *, scale: float,
               window: int = 0) -> torch.Tensor:
        """Attention of the pass's queries q [B, Hq, S, D] (at positions [B, S]) over this layer's
        keys and values (written already), causal, over the last `window` keys (0: all), scores
        scaled by `scale`: [B, Hq, S, D]."""
        if self.cache.kernel is not None:
            return attention_backend.kernel_attention(self.cache.kernel, q, self.cache.keys[layer],
                                                      self.cache.values[layer], self._block_tables,
                                                      self.cache.blocks.block_size, self._query_rows,
                                                      self._positions, self._path_start, self._path,
                                                      scale=scale, window=window)
        k, v = self.read(layer, self._kv_length)  # [B, Hkv, T, D]
        if q.shape[2] <= attention_backend.PER_QUERY_MAX or self.host_keys is not None:
            return attention_backend.per_query_attention(q, k, v, self.host_positions, self.host_keys,
                                                         scale=scale, window=window)
        return attention_backend.masked_attention(q, k, v, positions, scale=scale, window=window)

    def kernel_plan(self) -> KernelPlan | None:
        """This pass for native decoder layers (`draftwise/model/native_decoder.py`), or None where the
        cache's attention is not the native kernel."""
        if self.cache.kernel != "native":
            return None
        no_path = attention_backend.NO_PATH
        return KernelPlan(attention_backend.native_kernels().entry_points["paged_attention"], self.cache.keys,
                          self.cache.values, self._write_slots, self._block_tables, self.cache.blocks.block_size,
                          self._query_rows, self._positions, no_path if self._path is None else self._path_start,
                          no_path if self._path is None else self._path)

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, length, D] of this view's rows (the SDPA paths)."""
        if length != self._kv_length:
            raise ValueError(f"this view reads {self._kv_length} positions, not {length}")
        if self._slice is not None:
            return (self.cache.keys[layer, self._slice].unsqueeze(0).transpose(1, 2),
                    self.cache.values[layer, self._slice].unsqueeze(0).transpose(1, 2))
        return (self.cache.keys[layer][self._read_slots].transpose(1, 2),  # [B, T, Hkv, D] -> [B, Hkv, T, D]
                self.cache.values[layer][self._read_slots].transpose(1, 2))


def _stored_position(row_positions: list[int], host_paths: list[list[list[int]] | None] | None, b: int,
                    s: int) -> int:
    """Where token s of row b is stored: its position in a chain; one after another in a tree."""
    if host_paths is None or host_paths[b] is None:
        return row_positions[s]
    return row_positions[0] + s


def _pad_paths(row_paths: list[list[int]], row_positions: list[int]) -> list[list[int]]:
    """A tree row's paths for all S tokens of the pass: a padding token (past the row's own) reads
    the first new token's key, once per position up to its own (its output is dropped)."""
    start = row_positions[0]
    return row_paths + [[start] * (position - start + 1) for position in row_positions[len(row_paths):]]


def kernel_paths(host_positions: list[list[int]], host_paths: list[list[list[int]] | None],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' path_start [N] and path [N, S] (N queries row after row, S the longest row):
    each query's stored key positions from its row's first new token on (a chain row: the identity)."""
    width = max(map(len, host_positions))
    starts, rows = [], []
    for row_positions, row_paths in zip(host_positions, host_paths):
        start = row_positions[0]
        for s, position in enumerate(row_positions):
            path = row_paths[s] if row_paths is not None else list(range(start, position + 1))
            starts.append(start)
            rows.append(path + [start] * (width - len(path)))
    return torch.tensor(starts, device=device), torch.tensor(rows, device=device)


def _block_table(blocks: BlockManager, handles: list[int], length: int, device: torch.device) -> torch.Tensor:
    """[B, W] each row's first W = blocks_for(length) blocks (a row holding fewer: block 0 after its
    own, never attended)."""
    count = blocks.blocks_for(length)
    tables = [blocks.tables[handle][:count] for handle in handles]
    return torch.tensor([t + [0] * (count - len(t)) for t in tables], dtype=torch.long, device=device)


def write_kv(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, new_keys: torch.Tensor,
             new_values: torch.Tensor) -> None:
    """One layer's storage keys, values [slots, Hkv, D] take a pass's new_keys, new_values
    [B, Hkv, S, D] at `slots` [B*S], in place. Inside a compiled graph this is one op that says it
    mutates its arguments: otherwise the compiler copies the whole cache around every layer's
    write (which made a compiled step 5x slower); eagerly, `index_copy_` directly (no dispatch), or on
    CUDA one Triton kernel for both (`triton_kv_write.py`)."""
    new_keys, new_values = new_keys.transpose(1, 2).flatten(0, 1), new_values.transpose(1, 2).flatten(0, 1)
    if torch.compiler.is_compiling():
        _write_kv_op(keys, values, slots, new_keys, new_values)
    else:
        _index_copy(keys, values, slots, new_keys, new_values)


def _index_copy(keys, values, slots, new_keys, new_values) -> None:
    if keys.is_cuda:
        from draftwise.cache import triton_kv_write  # (Triton only where there is a GPU: ~70 MB resident)
        if triton_kv_write.available() and triton_kv_write.fits(keys, new_keys, new_values):
            triton_kv_write.write(keys, values, slots, new_keys, new_values)  # one kernel, not two
            return
    keys.index_copy_(0, slots, new_keys)
    values.index_copy_(0, slots, new_values)


@torch.library.custom_op("draftwise::write_kv", mutates_args=("keys", "values"))
def _write_kv_op(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, new_keys: torch.Tensor,
                 new_values: torch.Tensor) -> None:
    _index_copy(keys, values, slots, new_keys, new_values)
