"""RMSNorm as one Triton kernel, one program per row: the GPU's batch-invariant norm.

`x.pow(2).mean(-1)` on CUDA reduces a row in an order that depends on how many rows share the call
(with few rows, a row is split across more threads): on the H100 it was the first op whose output
differed when plain decoding's tokens were fed five at a time instead of one at a time, and so the
reason a target drafting for itself had drafts rejected in bf16. Here each program loads its whole
row (the hidden size rounded up to a power of two) and reduces it with one `tl.sum`, the same
instructions for every row whatever the grid: a row's result never depends on its neighbours.

`add_rms_norm` also adds the residual first (x + delta, rounded to the dtype as torch's add rounds),
writing both the sum and its norm in one launch: a decoder layer's attention output joins the
residual stream and is normed for the MLP in one kernel instead of two.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1), which the tests use.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: RMSNorm's torch ops (batch-invariant there) are used
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _normalize_and_store(x, weight_ptr, out_ptr, columns, inside, hidden, eps):
        """x [BLOCK] float32, one row (zero past `hidden`): its norm scaled by the weight, stored."""
        mean_square = tl.sum(x * x, axis=0) / hidden
        normed = x * tl.rsqrt(mean_square + eps)
        weight = tl.load(weight_ptr + columns, mask=inside, other=0.0)
        # As the torch path: normalize in fp32, round to the input's dtype, then scale by the weight.
        out = weight * normed.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + columns, out.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, stride_x, stride_out, hidden, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        columns = tl.arange(0, BLOCK)
        inside = columns < hidden
        x = tl.load(x_ptr + row * stride_x + columns, mask=inside, other=0.0).to(tl.float32)  # [BLOCK]
        _normalize_and_store(x, weight_ptr, out_ptr + row * stride_out, columns, inside, hidden, eps)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, sum_ptr, out_ptr, stride_x, stride_delta, stride_out,
                             hidden, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        columns = tl.arange(0, BLOCK)
        inside = columns < hidden
        x = tl.load(x_ptr + row * stride_x + columns, mask=inside, other=0.0).to(tl.float32)  # [BLOCK]
        delta = tl.load(delta_ptr + row * stride_delta + columns, mask=inside, other=0.0).to(tl.float32)
        total = (x + delta).to(sum_ptr.dtype.element_ty)  # torch's add: in fp32, rounded to the dtype
        tl.store(sum_ptr + row * stride_out + columns, total, mask=inside)
        _normalize_and_store(total.to(tl.float32), weight_ptr, out_ptr + row * stride_out, columns, inside, hidden, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] normalized row by row and scaled by weight [H] (same dtype as x): [..., H]."""
    rows = _rows(x)
    out = torch.empty_like(rows)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), rows.shape[1], eps,
                                       BLOCK=triton.next_power_of_2(rows.shape[1]))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x + delta [..., H] and its rows normed and scaled by weight [H]: ([..., H], [..., H])."""
    rows, deltas = _rows(x), _rows(delta)
    total, out = torch.empty_like(rows), torch.empty_like(rows)
    _add_rms_norm_kernel[(rows.shape[0],)](rows, deltas, weight, total, out, rows.stride(0), deltas.stride(0),
                                           out.stride(0), rows.shape[1], eps,
                                           BLOCK=triton.next_power_of_2(rows.shape[1]))
    return total.view(x.shape), out.view(x.shape)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., H] as rows [N, H] whose elements are adjacent (what the kernels index)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
