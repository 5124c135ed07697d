"""A forward pass as a function of tensors only, in buckets of fixed shapes: what a compiled step
(`torch.compile(fullgraph=True)`) and a CUDA graph need.

A decode or verification pass over R rows of at most S new tokens each is padded to the bucket
(R', S'), the next sizes in the row and token buckets: padding rows and tokens write their keys and
values to the cache's scratch slot, attend over positions that are never read back, and their
outputs are dropped. Every row's block table is padded to the width of the longest context the
runner allows, so lengths live in tensors and never in shapes: a bucket's graph serves every step
that fits it, whatever the lengths and the batch's composition. The LM head (the costliest matmul)
runs only on the tokens asked for: the last token of each row (L' = 1: decoding, a draft's
catch-up) or all S' of them (L' = S': verification); the bucket is (R', S', L').

The step needs an attention kernel (`draftwise.cache.attention_backend`: native on the CPU, Triton on
CUDA); without one, and for prompts (more tokens than the largest bucket), the runner's eager path
runs instead. Its modes:
- "eager": the same function, op by op (bit-identical to the runner's eager path: the same
  kernels, row-invariant, on the same rows);
- "compile": `torch.compile(fullgraph=True, dynamic=False)`, one graph per bucket, never a
  recompile within one (the number of buckets bounds the compilations);
- "graph" (CUDA): each bucket captured once as a CUDA graph over static input buffers, then
  replayed: one launch per step instead of ~1,000.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np
import torch

from draftwise.cache import attention_backend, token_tree
from draftwise.cache.kv_cache import KVCache, write_kv
from draftwise.errors import InvalidParameterError
from draftwise.model.transformer import Transformer

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MAX_BUCKET_TOKENS = 1024  # R' x S' at most: 64-token verification at up to 16 rows (each graph keeps its logits)
MODES = ("eager", "compile", "graph")

Bucket = tuple[int, int, int]  # (rows R', tokens per row S', logits per row L')


@dataclass(slots=True)
class StepTensors:
    """One bucket's inputs (R rows, S tokens each, W blocks per row, L logits per row), views of one
    flat int64 tensor (`flat`): a step's inputs reach the device in one copy."""

    token_ids: torch.Tensor  # [R, S]
    positions: torch.Tensor  # [R, S]
    write_slots: torch.Tensor  # [R*S] where each token's keys and values go (padding: the scratch slot)
    block_tables: torch.Tensor  # [R, W]
    query_rows: torch.Tensor  # [R*S]
    logit_index: torch.Tensor  # [R*L] which of the R*S tokens go through the LM head
    path_start: torch.Tensor  # [R*S] each query's row length before the pass
    path: torch.Tensor  # [R*S, S] the stored positions each query reads from there on (token trees; chains: in order)
    flat: torch.Tensor  # [sum of the above's sizes] what they view

    @staticmethod
    def shapes(bucket: Bucket, width: int) -> list[tuple[int, ...]]:
        rows, tokens, logits = bucket
        queries = rows * tokens
        return [(rows, tokens), (rows, tokens), (queries,), (rows, width), (queries,), (rows * logits,), (queries,),
                (queries, tokens)]

    @classmethod
    def viewing(cls, flat: torch.Tensor, bucket: Bucket, width: int) -> "StepTensors":
        shapes = cls.shapes(bucket, width)
        pieces = flat.split([math.prod(shape) for shape in shapes])
        return cls(*(piece.view(shape) for piece, shape in zip(pieces, shapes)), flat)


class TensorKVView:
    """The model's `KVCacheView` over tensors only (no host lists): what a traced graph can hold."""

    def __init__(self, cache: KVCache, inputs: StepTensors) -> None:
        self.cache, self.inputs = cache, inputs

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """New keys/values [R, Hkv, S, D] into their slots."""
        write_kv(self.cache.keys[layer], self.cache.values[layer], self.inputs.write_slots, keys, values)

    def write_target(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The layer's storage keys, values [slots, Hkv, D] and the pass's slots [R*S], for the GPU's
        rotation kernel to store into (`triton_rotary`); None inside a compiled graph (its writes go
        through the op that says it mutates the cache: `write_kv`)."""
        if torch.compiler.is_compiling():
            return None
        return self.cache.keys[layer], self.cache.values[layer], self.inputs.write_slots

    def attend(self, layer: int, q: torch.Tensor, positions: torch.Tensor, *, scale: float,
               window: int = 0) -> torch.Tensor:
        """q [R, Hq, S, D] -> [R, Hq, S, D]."""
        return attention_backend.kernel_attention(self.cache.kernel, q, self.cache.keys[layer],
                                                  self.cache.values[layer], self.inputs.block_tables,
                                                  self.cache.blocks.block_size, self.inputs.query_rows,
                                                  positions.flatten(), self.inputs.path_start, self.inputs.path,
                                                  scale=scale, window=window)


def step_logits(model: Transformer, cache: KVCache, inputs: StepTensors) -> torch.Tensor:
    """Logits [R*L, V] of the tokens `inputs.logit_index` names."""
    hidden, _ = model.hidden_states(inputs.token_ids, inputs.positions, TensorKVView(cache, inputs))
    picked = hidden.flatten(0, 1).index_select(0, inputs.logit_index)  # [R*L, H]
    return model.logits(picked)


class StaticStep:
    def __init__(self, model: Transformer, cache: KVCache, max_len: int, mode: str = "eager", *,
                 row_buckets: tuple[int, ...] = ROW_BUCKETS, token_buckets: tuple[int, ...] = TOKEN_BUCKETS) -> None:
        if mode not in MODES:
            raise InvalidParameterError(f"step mode must be one of {MODES}, got {mode!r}")
        if cache.kernel is None:
            raise InvalidParameterError("a static step needs an attention kernel for this device and dtype")
        if mode == "graph" and cache.keys.device.type != "cuda":
            raise InvalidParameterError("step mode 'graph' captures CUDA graphs: it needs a CUDA device")
        self.model, self.cache, self.mode = model, cache, mode
        self.row_buckets, self.token_buckets = tuple(sorted(row_buckets)), tuple(sorted(token_buckets))
        self.width = cache.blocks.blocks_for(max_len)  # blocks per row in every table
        self.device = cache.keys.device
        self.compilations = 0  # graphs compiled or captured: at most one per bucket
        self._seen: set[Bucket] = set()
        self._graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, StepTensors, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if mode == "graph" else None  # one memory pool for all buckets
        self._staging: torch.Tensor | None = None  # pinned host memory a graph's inputs are sent from
        self._sent: torch.cuda.Event | None = None  # recorded after the last copy out of it
        self._function = step_logits
        if mode == "compile":
            buckets = 2 * len(self.row_buckets) * len(self.token_buckets)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * buckets)
            torch._dynamo.config.fail_on_recompile_limit_hit = True  # never fall back to eager silently
            self._function = torch.compile(step_logits, fullgraph=True, dynamic=False)

    def fits(self, num_rows: int, num_tokens: int) -> bool:
        if num_rows > self.row_buckets[-1] or num_tokens > self.token_buckets[-1]:
            return False
        rows, tokens, _ = self.bucket(num_rows, num_tokens, False)
        return rows * tokens <= max(MAX_BUCKET_TOKENS, self.row_buckets[-1])

    def bucket(self, num_rows: int, num_tokens: int, all_logits: bool) -> Bucket:
        rows = self.row_buckets[bisect.bisect_left(self.row_buckets, num_rows)]
        tokens = self.token_buckets[bisect.bisect_left(self.token_buckets, num_tokens)]
        return rows, tokens, tokens if all_logits else 1

    def prepare(self, bucket: Bucket, rows: list[int], token_ids: list[list[int]], lengths: list[int],
                parents: list[list[int] | None] | None = None) -> torch.Tensor:
        """The bucket's inputs: row b's token_ids[b] appended after its lengths[b] cached tokens
        (the sequences' blocks already cover them), as a chain or, where parents[b] says, a token
        tree (`draftwise.cache.token_tree`). Built on the host with numpy: one flat int64 host tensor
        that `run` sends in one copy (`StepTensors` views it there)."""
        num_rows, width, num_logits = bucket
        blocks, size, table_width, real = self.cache.blocks, self.cache.blocks.block_size, self.width, len(rows)
        steps = np.arange(width)
        tokens = np.zeros((num_rows, width), np.int64)
        tokens[:real] = [list(ids) + [0] * (width - len(ids)) for ids in token_ids]
        tables = np.zeros((num_rows, table_width), np.int64)
        tables[:real] = [table + [0] * (table_width - len(table))
                         for table in (blocks.tables[row][:table_width] for row in rows)]
        starts = np.zeros(num_rows, np.int64)
        starts[:real] = lengths
        counts = np.zeros(num_rows, np.int64)
        counts[:real] = [len(ids) for ids in token_ids]
        stored = starts[:, None] + steps  # [R, S] where the new tokens are stored, in order
        padding = steps >= counts[:, None]  # [R, S] (the rest: the rows' new tokens)
        block_index, offset = np.divmod(stored, size)
        block_index[padding] = 0
        slots = tables[np.arange(num_rows)[:, None], block_index] * size + offset  # [R, S]
        slots[padding] = self.cache.scratch_slot
        positions = np.where(padding, starts[:, None], stored)  # a chain's; padding at the row's start
        tree_paths: dict[int, list[list[int]]] = {}  # row -> [S][S] its queries' paths (trees only)
        for b, row_parents in enumerate(parents or ()):
            if row_parents is not None:
                start, count = lengths[b], len(token_ids[b])
                positions[b, :count] = start + np.asarray(token_tree.depths(row_parents), np.int64)
                row_paths = token_tree.paths(row_parents, start) + [[start]] * (width - count)  # (padding)
                tree_paths[b] = [path + [start] * (width - len(path)) for path in row_paths]
        if num_logits == 1:
            picks = np.arange(num_rows) * width + np.maximum(counts - 1, 0)
        else:
            picks = np.arange(num_rows * width)
        path_start = np.repeat(starts, width)  # [R*S]
        # A chain reads its keys in place: the path from the start on is the identity (entries past a
        # query's position are never read).
        path = path_start[:, None] + steps[None, :]  # [R*S, S]
        for b, row_paths in tree_paths.items():
            path[b * width:(b + 1) * width] = row_paths
        flat = np.concatenate([tokens.ravel(), positions.ravel(), slots.ravel(), tables.ravel(),
                               np.repeat(np.arange(num_rows), width), picks, path_start, path.ravel()])
        return torch.from_numpy(flat)

    def run(self, bucket: Bucket, host_inputs: torch.Tensor) -> torch.Tensor:
        """Logits [R'*L', V] of the bucket, its inputs as `prepare` made them (valid until the next run
        of the same bucket in "graph" mode)."""
        if bucket not in self._seen:
            self._seen.add(bucket)
            self.compilations += self.mode != "eager"
        if self.mode != "graph":
            return self._function(self.model, self.cache, self._on_device(bucket, host_inputs))
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket, self._on_device(bucket, host_inputs))
        graph, static_inputs, static_logits = self._graphs[bucket]
        self._send(host_inputs, static_inputs.flat)
        graph.replay()
        return static_logits

    def _on_device(self, bucket: Bucket, host_inputs: torch.Tensor) -> StepTensors:
        return StepTensors.viewing(host_inputs.to(self.device), bucket, self.width)

    def _send(self, host: torch.Tensor, device: torch.Tensor) -> None:
        """host [N] -> device [N] through a pinned buffer: the host does not wait for the device (a copy
        from pageable memory would), and no tensor is allocated a step. The buffer is rewritten only
        once the last copy out of it has run."""
        if self._sent is not None:
            self._sent.synchronize()
        if self._staging is None or self._staging.numel() < host.numel():
            self._staging = torch.empty(host.numel(), dtype=host.dtype, pin_memory=True)
            self._sent = torch.cuda.Event()
        staging = self._staging[:host.numel()]
        staging.copy_(host)
        device.copy_(staging, non_blocking=True)
        self._sent.record()

    def _capture(self, bucket: Bucket, inputs: StepTensors) -> tuple[torch.cuda.CUDAGraph, StepTensors, torch.Tensor]:
        """Capture the bucket's step on a side stream, after one warm-up run (Triton compiles its
        kernels there; nothing may allocate or synchronize inside the capture). The warm-up runs on
        the real inputs: its writes are the step's own."""
        static_inputs = StepTensors.viewing(inputs.flat.clone(), bucket, self.width)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step_logits(self.model, self.cache, static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            static_logits = step_logits(self.model, self.cache, static_inputs)
        return graph, static_inputs, static_logits
