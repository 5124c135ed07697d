"""Rotary embedding of a pass's queries and keys as one Triton kernel: the GPU's rotation.

Op by op, `apply_rotary` is five kernels a tensor (the negated half, the concatenation, two products,
the sum), ten a layer for the queries and keys, and two more copies that put them back in token order
for the cache write and the attention kernel: 12 of the ~26 kernels of a decoder layer in a CUDA
graph, each a few microseconds of launch for a few kilobytes of work (an H200's one-row step: 724
kernels, 0.8 ms of its 3.1 ms in small elementwise kernels; BENCHMARKS.md, the GPU issue). Here one
launch reads the query and key heads straight from the QKV projection's output and writes them
rotated, token-major: queries [N, Hq, D], keys [N, Hkv, D] (N = the pass's tokens), the layouts the
cache write and the attention kernel read without a copy; or, given the layer's cache storage and the
tokens' slots, stores the rotated keys and the values there itself (the cache write's kernel too).

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
    def _rotary_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, values_ptr, slots_ptr, stride_qkv, stride_angles,
                       stride_slot, HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, TO_CACHE: tl.constexpr):
        n = tl.program_id(0)  # the token
        h = tl.program_id(1)  # the head: queries 0..HQ-1, then keys, then (TO_CACHE) values
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
        head = h * HALF + i  # [HALF], all alike in a program: which stores it makes
        is_query = head < HQ * HALF
        is_key = (head >= HQ * HALF) & (head < (HQ + HKV) * HALF)
        q_out = q_ptr + (n * HQ + h) * 2 * HALF + i
        tl.store(q_out, first.to(dtype), mask=is_query)
        tl.store(q_out + HALF, second.to(dtype), mask=is_query)
        if TO_CACHE:  # keys rotated and values as they are, straight into the token's cache slot
            slot = tl.load(slots_ptr + n)
            k_out = k_ptr + slot * stride_slot + (h - HQ) * 2 * HALF + i
            is_value = head >= (HQ + HKV) * HALF
            v_out = values_ptr + slot * stride_slot + (h - HQ - HKV) * 2 * HALF + i
            tl.store(v_out, x1.to(dtype), mask=is_value)  # (bf16 -> fp32 -> bf16: the same bits)
            tl.store(v_out + HALF, x2.to(dtype), mask=is_value)
        else:
            k_out = k_ptr + (n * HKV + h - HQ) * 2 * HALF + i
        tl.store(k_out, first.to(dtype), mask=is_key)
        tl.store(k_out + HALF, second.to(dtype), mask=is_key)


def rotate_queries_and_keys(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                            num_kv_heads: int, head_dim: int,
                            cache_slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rotated queries [N, Hq, D] and keys [N, Hkv, D] of qkv [..., (Hq + 2 Hkv) D] (N tokens: every
    leading dimension), by cos, sin [..., D] of the same tokens (e.g. [B, 1, S, D] for qkv [B, S, .]).

    cache_slots (keys, values [slots, Hkv, D] of a layer's cache, slots [N]): the same launch stores the
    rotated keys and the values into token n's slot (what `triton_kv_write` would copy there, the same
    bits) and returns (queries, None)."""
    rows = qkv.reshape(-1, qkv.shape[-1])  # [N, (Hq + 2 Hkv) D]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    tokens = rows.shape[0]
    cos, sin = cos.reshape(tokens, head_dim), sin.reshape(tokens, head_dim)  # [N, D]
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if cache_slots is None:
        k = torch.empty(tokens, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
        values, slots, stride_slot, heads = k, k, 0, num_heads + num_kv_heads
    else:
        k, values, slots = cache_slots
        stride_slot, heads = k.stride(0), num_heads + 2 * num_kv_heads
    _rotary_kernel[(tokens, heads)](rows, cos, sin, q, k, values, slots, rows.stride(0), cos.stride(0), stride_slot,
                                    HQ=num_heads, HKV=num_kv_heads, HALF=head_dim // 2,
                                    TO_CACHE=cache_slots is not None, enable_fp_fusion=False)
    return q, (k if cache_slots is None else None)


def fits_cache(keys: torch.Tensor, values: torch.Tensor, qkv: torch.Tensor) -> bool:
    """Whether a layer's cache storage keys, values [slots, Hkv, D] can take the kernel's stores: each
    slot's heads contiguous, in qkv's dtype."""
    return all(t.dim() == 3 and t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] and t.stride(0) == keys.stride(0)
               and t.dtype == qkv.dtype for t in (keys, values))
