"""SwiGLU's silu(gate) * up as one Triton kernel: the GPU's, one launch where torch's ops take two
(the silu, then the product) and read the gate-up output twice.

Each program takes one token's BLOCK columns: a token's result never depends on the other tokens in
the pass. The rounding is the op-by-op path's: silu computed in float32 and rounded to the tensors'
dtype, then the product rounded (the exponential is Triton's, so the last bit of a silu may differ
from torch's kernel; the engine takes one path or the other for every pass, never both).

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1), which the tests use.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the native op or torch's
    triton = None

BLOCK = 1024  # columns a program


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, intermediate, BLOCK: tl.constexpr):
        n = tl.program_id(0)  # the token
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = columns < intermediate
        gate = tl.load(gate_up_ptr + n * stride_in + columns, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + n * stride_in + intermediate + columns, mask=inside, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + n * stride_out + columns, (silu * up).to(dtype), mask=inside)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2I] (gate first): [..., I]."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])  # [N, 2I]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    intermediate = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], intermediate, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(intermediate, BLOCK))](rows, out, rows.stride(0), out.stride(0),
                                                                         intermediate, BLOCK=BLOCK,
                                                                         enable_fp_fusion=False)
    return out.view(*gate_up.shape[:-1], intermediate)
