"""Causal attention of any number of queries over the paged KV cache, as one Triton kernel: the
GPU's counterpart of `kernels/paged_attention.cpp`.

One program per (query, kv head) computes the attention of that query's group of heads over its
own row's keys, read in place through the row's block table, block after block of BLOCK_N positions
in a fixed order (online softmax, fp32 accumulation). No program reads another query's data or
depends on how many programs run, so a query's result is the same alone, in a verification pass of
k + 1 tokens, in a batch of 64 rows or in a prefill: the batch invariance speculation needs to stay
bit-exact. One launch per layer replaces SDPA calls per query; the shapes the launch sees (queries,
heads, head_dim) are all a CUDA graph needs, the lengths live in tensors.

Without a GPU the same kernel runs in Triton's interpreter (TRITON_INTERPRET=1), which the tests use
to check it against SDPA and for invariance.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton ships with CUDA builds of PyTorch; CPU machines use the native kernel
    triton = None

BLOCK_N = 32  # key positions per block: fixed, so a query's reduction order never changes


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, rows_ptr, positions_ptr, path_start_ptr, path_ptr,
                                out_ptr, scale, window, stride_q_n, stride_q_h, stride_kv_s, stride_kv_h, stride_tables_b,
                                stride_path_n, page_size, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                                HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_PATH: tl.constexpr):
        n = tl.program_id(0)  # the query
        g = tl.program_id(1)  # its kv head; query heads g * GROUP .. g * GROUP + GROUP - 1 share it
        row = tl.load(rows_ptr + n)
        position = tl.load(positions_ptr + n)
        if HAS_PATH:  # a token tree: key positions from path_start on are read where the path says
            path_start = tl.load(path_start_ptr + n)
        heads = g * GROUP + tl.arange(0, GROUP_PAD)  # [G]
        head_ok = tl.arange(0, GROUP_PAD) < GROUP
        dims = tl.arange(0, HEAD_DIM)  # [D]
        q = tl.load(q_ptr + n * stride_q_n + heads[:, None] * stride_q_h + dims[None, :],
                    mask=head_ok[:, None], other=0.0)  # [G, D]
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        first = position * 0  # (position's integer type: the window branch may not change it)
        if window > 0:  # a sliding window: keys position - window + 1 .. position
            first = tl.maximum(position - window + 1, 0)
        for start in range(first // BLOCK * BLOCK, position + 1, BLOCK):  # (blocks aligned the same for every query)
            offsets = start + tl.arange(0, BLOCK)  # [N]
            visible = (offsets <= position) & (offsets >= first)
            stored = offsets
            if HAS_PATH:
                on_path = visible & (offsets >= path_start)
                stored = tl.where(on_path, tl.load(path_ptr + n * stride_path_n + offsets - path_start, mask=on_path,
                                                   other=0), offsets)
            pages = tl.load(tables_ptr + row * stride_tables_b + stored // page_size, mask=visible, other=0)
            slots = pages * page_size + stored % page_size
            kv_offsets = slots[:, None] * stride_kv_s + g * stride_kv_h + dims[None, :]  # [N, D]
            k = tl.load(k_ptr + kv_offsets, mask=visible[:, None], other=0.0)
            v = tl.load(v_ptr + kv_offsets, mask=visible[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G, N] (float32 caches: no TF32)
            scores = tl.where(visible[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            weights = tl.exp(scores - m_new[:, None])
            rescale = tl.exp(m - m_new)
            total = total * rescale + tl.sum(weights, axis=1)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
            m = m_new
        out = acc / total[:, None]
        tl.store(out_ptr + n * stride_q_n + heads[:, None] * stride_q_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


def triton_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_tables: torch.Tensor,
                     block_size: int, query_rows: torch.Tensor, positions: torch.Tensor,
                     path_start: torch.Tensor | None = None, path: torch.Tensor | None = None, *,
                     scale: float | None = None, window: int = 0) -> torch.Tensor:
    """q [B, Hq, S, D] over one layer's storage keys/values [slots, Hkv, D]; block_tables [B, W] each
    row's blocks of `block_size` slots in position order; query_rows, positions [B*S]; for token
    trees path_start [B*S] and path [B*S, T] (see `kernels/paged_attention.cpp`); scores scaled by
    `scale` (None: D^-1/2), over the last `window` keys (0: all). Returns [B, Hq, S, D]."""
    batch, heads, seq, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    flat = q.transpose(1, 2).reshape(batch * seq, heads, dim).contiguous()  # [N, Hq, D]
    out = torch.empty_like(flat)
    has_path = path is not None and path.numel() > 0
    if not has_path:
        path_start = path = positions  # never read
    _paged_attention_kernel[(batch * seq, kv_heads)](
        flat, keys, values, block_tables, query_rows, positions, path_start, path, out, dim ** -0.5 if scale is None else scale, window,
        flat.stride(0), flat.stride(1), keys.stride(0), keys.stride(1), block_tables.stride(0),
        path.stride(0) if has_path else 0, block_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=dim, BLOCK=BLOCK_N, HAS_PATH=has_path)
    return out.view(batch, seq, heads, dim).transpose(1, 2)
