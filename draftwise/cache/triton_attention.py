"""Causal attention of any number of queries over the paged KV cache, in Triton: the GPU's
counterpart of `kernels/paged_attention.cpp`.

A query's keys are read in place through its row's block table, in blocks of BLOCK_N positions
aligned the same way for every query. The blocks are dealt out to SPLITS programs per (query, kv
head), program p taking blocks p, p + SPLITS, p + 2 SPLITS, ... in order (online softmax, fp32
accumulation); a second kernel merges the SPLITS partial results in the order p = 0, 1, ... (flash
decoding with a fixed split: one query's 256 keys are eight programs' work, not one's). Both the
dealing and the merging depend on the query's own position only, never on how many queries share
the launch, so a query's result is the same alone, in a verification pass of k + 1 tokens, in a
batch of 64 rows or in a prefill: the batch invariance speculation needs to stay bit-exact. Two
launches per layer replace SDPA calls per query; the shapes they see (queries, heads, head_dim) are
all a CUDA graph needs, the lengths live in tensors.

Without a GPU the same kernels run in Triton's interpreter (TRITON_INTERPRET=1), which the tests use
to check them against SDPA and for invariance.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton ships with CUDA builds of PyTorch; CPU machines use the native kernel
    triton = None

BLOCK_N = 32  # key positions per block: fixed, so a query's reduction order never changes
SPLITS = 8  # programs per (query, kv head), each over every SPLITS-th block: fixed for the same reason


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _partial_attention_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, rows_ptr, positions_ptr, path_start_ptr,
                                  path_ptr, partial_ptr, stats_ptr, scale, window, stride_q_n, stride_q_h,
                                  stride_kv_s, stride_kv_h, stride_tables_b, stride_path_n, page_size,
                                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                                  BLOCK: tl.constexpr, SPLITS: tl.constexpr, HAS_PATH: tl.constexpr):
        n = tl.program_id(0)  # the query
        g = tl.program_id(1)  # its kv head; query heads g * GROUP .. g * GROUP + GROUP - 1 share it
        p = tl.program_id(2)  # which of the query's SPLITS programs: blocks p, p + SPLITS, ...
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
        # Blocks aligned the same for every query; this program's are every SPLITS-th from its own.
        for start in range((first // BLOCK + p) * BLOCK, position + 1, SPLITS * BLOCK):
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
        # This program's share, unnormalized: partial [N, Hkv, SPLITS, G, D], stats [N, Hkv, SPLITS, 2, G].
        part = ((n * tl.num_programs(1) + g) * SPLITS + p).to(tl.int64)  # (int32 offsets wrap past 2**31)
        groups = tl.arange(0, GROUP_PAD)
        tl.store(partial_ptr + part * GROUP * HEAD_DIM + groups[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=head_ok[:, None])
        tl.store(stats_ptr + part * 2 * GROUP + groups, m, mask=head_ok)
        tl.store(stats_ptr + part * 2 * GROUP + GROUP + groups, total, mask=head_ok)

    @triton.jit
    def _merge_kernel(partial_ptr, stats_ptr, out_ptr, stride_q_n, stride_q_h, GROUP: tl.constexpr,
                      GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
        n = tl.program_id(0)
        g = tl.program_id(1)
        groups = tl.arange(0, GROUP_PAD)
        head_ok = groups < GROUP
        dims = tl.arange(0, HEAD_DIM)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for p in tl.static_range(SPLITS):  # in program order; program 0 always read a block, so m is finite after it
            part = ((n * tl.num_programs(1) + g) * SPLITS + p).to(tl.int64)
            m_p = tl.load(stats_ptr + part * 2 * GROUP + groups, mask=head_ok, other=0.0)
            total_p = tl.load(stats_ptr + part * 2 * GROUP + GROUP + groups, mask=head_ok, other=0.0)
            acc_p = tl.load(partial_ptr + part * GROUP * HEAD_DIM + groups[:, None] * HEAD_DIM + dims[None, :],
                            mask=head_ok[:, None], other=0.0)
            m_new = tl.maximum(m, m_p)
            mine, theirs = tl.exp(m - m_new), tl.exp(m_p - m_new)  # (a program that read nothing: m_p = -inf, 0)
            total = total * mine + total_p * theirs
            acc = acc * mine[:, None] + acc_p * theirs[:, None]
            m = m_new
        out = acc / total[:, None]
        heads = g * GROUP + groups
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
    queries, group_pad = batch * seq, max(16, triton.next_power_of_2(group))
    partial = torch.empty(queries, kv_heads, SPLITS, group, dim, dtype=torch.float32, device=q.device)
    stats = torch.empty(queries, kv_heads, SPLITS, 2, group, dtype=torch.float32, device=q.device)  # max, sum
    _partial_attention_kernel[(queries, kv_heads, SPLITS)](
        flat, keys, values, block_tables, query_rows, positions, path_start, path, partial, stats,
        dim ** -0.5 if scale is None else scale, window, flat.stride(0), flat.stride(1), keys.stride(0),
        keys.stride(1), block_tables.stride(0), path.stride(0) if has_path else 0, block_size, GROUP=group,
        GROUP_PAD=group_pad, HEAD_DIM=dim, BLOCK=BLOCK_N, SPLITS=SPLITS, HAS_PATH=has_path)
    _merge_kernel[(queries, kv_heads)](partial, stats, out, flat.stride(0), flat.stride(1), GROUP=group,
                                       GROUP_PAD=group_pad, HEAD_DIM=dim, SPLITS=SPLITS)
    return out.view(batch, seq, heads, dim).transpose(1, 2)
