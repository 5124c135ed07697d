"""Attention over the paged KV cache: the backend every forward pass goes through.

- native (`kernels/paged_attention.h`, CPU, fp32, AVX-512 or AVX2): every query of the pass in one call,
  keys read in place through each row's block table, one fixed order of arithmetic per query; so a
  query's result never depends on how many queries or rows share the pass, for decode,
  verification, draft catch-up and prefill alike.
- triton (`triton_attention.py`, CUDA): the same algorithm as one Triton kernel per layer.
- per query (any device): each query alone over exactly the keys at positions <= its own, one SDPA
  call each: the same call, on the same shapes, one-token decoding makes, hence batch-invariant
  too, but launched from Python per query (up to PER_QUERY_MAX queries per row).
- masked (any device, long prompts past PER_QUERY_MAX): one SDPA call with a causal mask; fast for
  prefill, not batch-invariant (a draft model's catch-up may then round differently from the
  target's prefill: only acceptance can suffer, never the output).

Sliding windows (Gemma 3's local layers): a query at position p reads keys p - window + 1 .. p, in
every backend, in the same order it reads them without one.

Token trees: a pass may carry, per query, a *path* (`path_start` [N], `path` [N, T]): its key
positions from path_start on are read from the stored positions the path lists (its ancestors in
the tree, then itself). Every backend but the masked one honours it, reading exactly the keys a
chain of those ancestors would hold, in the same order: a tree node's attention is bit for bit that
of the same token verified in a chain.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from draftwise import native

PER_QUERY_MAX = 64
KERNELS = Path(__file__).resolve().parent / "kernels"
BUILDS = (
    native.Build("avx512", (KERNELS / "paged_attention_avx512.cpp",), ("-O3", "-fopenmp", "-mavx512f", "-mfma"),
                 ("avx512f", "fma"), (KERNELS / "paged_attention.h",)),
    native.Build("avx2", (KERNELS / "paged_attention_avx2.cpp",), ("-O3", "-fopenmp", "-mavx2", "-mfma"),
                 ("avx2", "fma"), (KERNELS / "paged_attention.h",)),
)


@cache
def native_kernels():
    """The compiled paged-attention extension, or None where it cannot be had."""
    return native.build("attention", BUILDS)


def kernel_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """"native", "triton", or None (the SDPA paths) for a cache on this device, in this dtype."""
    if device.type == "cpu" and dtype == torch.float32 and head_dim % 16 == 0 and head_dim <= 256 \
            and native_kernels() is not None:
        return "native"
    if device.type == "cuda" and head_dim in (16, 32, 64, 128, 256):  # (tl.dot: powers of two from 16)
        from draftwise.cache import triton_attention  # (Triton only where there is a GPU: ~70 MB resident)
        if triton_attention.available():
            return "triton"
    return None


def kernel_attention(kernel: str, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     block_tables: torch.Tensor, block_size: int, query_rows: torch.Tensor,
                     positions: torch.Tensor, path_start: torch.Tensor | None = None,
                     path: torch.Tensor | None = None, *, scale: float | None = None, window: int = 0) -> torch.Tensor:
    if kernel == "native":
        attend = native_attention
    else:
        from draftwise.cache.triton_attention import triton_attention as attend
    return attend(q, keys, values, block_tables, block_size, query_rows, positions, path_start, path,
                  scale=scale, window=window)


@torch.library.custom_op("draftwise::paged_attention", mutates_args=())
def _paged_attention_op(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
                        block_size: int, query_rows: torch.Tensor, positions: torch.Tensor, path_start: torch.Tensor,
                        path: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """The native kernel as a custom op, so that `torch.compile(fullgraph=True)` traces through it."""
    return native_kernels().paged_attention(q, keys, values, block_tables, block_size, query_rows, positions,
                                            path_start, path, scale, window)


@_paged_attention_op.register_fake
def _(q, keys, values, block_tables, block_size, query_rows, positions, path_start, path, scale, window):
    return torch.empty_like(q)


def native_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
                     block_size: int, query_rows: torch.Tensor, positions: torch.Tensor,
                     path_start: torch.Tensor | None = None, path: torch.Tensor | None = None, *,
                     scale: float | None = None, window: int = 0) -> torch.Tensor:
    """q [B, Hq, S, D] over one layer's storage keys/values [slots, Hkv, D]; block_tables [B, W] each
    row's blocks of `block_size` slots in position order; query_rows, positions [B*S]; token trees'
    path_start [B*S] and path [B*S, T] (None: no tree); scores scaled by `scale` (None: D^-1/2), over
    the last `window` keys up to each position (0: all). Returns [B, Hq, S, D]."""
    batch, heads, seq, dim = q.shape
    scale = dim ** -0.5 if scale is None else scale
    flat = q.transpose(1, 2).reshape(batch * seq, heads, dim).contiguous()  # [N, Hq, D]
    if path is None:
        path_start = path = NO_PATH
    if torch.compiler.is_compiling():
        out = _paged_attention_op(flat, keys, values, block_tables, block_size, query_rows, positions, path_start, path,
                                  scale, window)
    else:
        out = native_kernels().paged_attention(flat, keys, values, block_tables, block_size, query_rows, positions,
                                               path_start, path, scale, window)
    return out.view(batch, seq, heads, dim).transpose(1, 2)


NO_PATH = torch.empty(0, dtype=torch.long)


def per_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, host_positions: list[list[int]],
                        host_keys: list[list[list[int]] | None] | None = None, *, scale: float | None = None,
                        window: int = 0) -> torch.Tensor:
    """q [B, Hq, S, D] over k, v [B, Hkv, T, D]: each query alone over keys 0..its position, or,
    where host_keys[b][s] lists them (a token tree), over exactly those stored positions; the last
    `window` of them only (0: all)."""
    rows = []
    for b, row_positions in enumerate(host_positions):
        keys_of = host_keys[b] if host_keys is not None else None
        outputs = []
        for s, p in enumerate(row_positions):
            first = max(0, p + 1 - window) if window else 0
            if keys_of is None:
                key, value = k[b:b + 1, :, first:p + 1], v[b:b + 1, :, first:p + 1]
            else:
                index = torch.tensor(keys_of[s][first:], device=k.device)
                key, value = k[b:b + 1, :, index], v[b:b + 1, :, index]
            outputs.append(F.scaled_dot_product_attention(q[b:b + 1, :, s:s + 1], key, value, enable_gqa=True,
                                                          scale=scale))
        rows.append(torch.cat(outputs, dim=2))
    return torch.cat(rows)  # [B, Hq, S, D]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, *,
                     scale: float | None = None, window: int = 0) -> torch.Tensor:
    """q [B, Hq, S, D] over k, v [B, Hkv, T, D], a query at position p seeing keys at positions <= p
    (and > p - window with a window)."""
    key_positions = torch.arange(k.shape[2], device=q.device)[None, None, None, :]  # [1, 1, 1, T]
    query_positions = positions[:, None, :, None]  # [B, 1, S, 1]
    mask = key_positions <= query_positions  # [B, 1, S, T]
    if window:
        mask &= key_positions > query_positions - window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)
