"""Rotary embedding of a pass's queries and keys as one Triton kernel: the GPU's rotation.

Op by op, `apply_rotary` is five kernels a tensor (the negated half, the concatenation, two products,
the sum), ten a layer for the queries and keys, and two more copies that put them back in token order
for the cache write and the attention kernel: 12 of the ~26 kernels of a decoder layer in a CUDA
graph, each a few microseconds of launch for a few kilobytes of work (an H200's one-row step: 724
kernels, 0.8 ms of its 3.1 ms in small elementwise kernels; BENCHMARKS.md, the GPU issue). Here one
launch reads the query and key heads straight from the QKV projection's output and writes them
rotated, token-major: queries [N, Hq, D], keys [N, Hkv, D] (N = the pass's tokens), the layouts the
cache write and the attention kernel read without a copy.

The arithmetic is `apply_rotary`'s, rounded where it rounds: each product rounded to the tensors'
dtype, then their sum (first half x1 cos - x2 sin, second x2 cos + x1 sin), and the launch asks for
no fused multiply-add, so the bits are the op-by-op path's. Each program rotates one head of one
token: a token's result never depends on the others in the pass.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1), which the tests use.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: `apply_rotary` (the native op or torch's)
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _rotary_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, stride_qkv, stride_angles,
                       HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr):
        n = tl.program_id(0)  # the token
        h = tl.program_id(1)  # the head: queries 0..HQ-1, then keys
        i = tl.arange(0, HALF)
        source = qkv_ptr + n * stride_qkv + h * 2 * HALF  # (the QKV output holds the heads in this order)
        x1 = tl.load(source + i).to(tl.float32)
        x2 = tl.load(source + HALF + i).to(tl.float32)
        angles = n * stride_angles + i
        cos1 = tl.load(cos_ptr + angles).to(tl.float32)
        cos2 = tl.load(cos_ptr + angles + HALF).to(tl.float32)
        sin1 = tl.load(sin_ptr + angles).to(tl.float32)
        sin2 = tl.load(sin_ptr + angles + HALF).to(tl.float32)
        dtype = q_ptr.dtype.element_ty
        first = (x1 * cos1).to(dtype).to(tl.float32) - (x2 * sin1).to(dtype).to(tl.float32)
        second = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
        is_query = h * HALF + i < HQ * HALF  # [HALF], all alike: a query head's stores go to q, a key's to k
        is_key = h * HALF + i >= HQ * HALF
        q_out = q_ptr + (n * HQ + h) * 2 * HALF + i
        k_out = k_ptr + (n * HKV + h - HQ) * 2 * HALF + i
        tl.store(q_out, first.to(dtype), mask=is_query)
        tl.store(q_out + HALF, second.to(dtype), mask=is_query)
        tl.store(k_out, first.to(dtype), mask=is_key)
        tl.store(k_out + HALF, second.to(dtype), mask=is_key)


def rotate_queries_and_keys(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                            num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated queries [N, Hq, D] and keys [N, Hkv, D] of qkv [..., (Hq + 2 Hkv) D] (N tokens: every
    leading dimension), by cos, sin [..., D] of the same tokens (e.g. [B, 1, S, D] for qkv [B, S, .])."""
    rows = qkv.reshape(-1, qkv.shape[-1])  # [N, (Hq + 2 Hkv) D]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    tokens = rows.shape[0]
    cos, sin = cos.reshape(tokens, head_dim), sin.reshape(tokens, head_dim)  # [N, D]
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(tokens, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rotary_kernel[(tokens, num_heads + num_kv_heads)](rows, cos, sin, q, k, rows.stride(0), cos.stride(0),
                                                        HQ=num_heads, HKV=num_kv_heads, HALF=head_dim // 2,
                                                        enable_fp_fusion=False)
    return q, k
