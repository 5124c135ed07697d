"""A linear layer whose rows never depend on each other, as one Triton kernel: the GPU's batch-invariant
matrix product for float32.

cuBLAS chooses its kernel by the shape: with few rows it splits K across thread blocks and adds the
pieces (split-K), with more rows it does not, so a row's dot products are summed in another order
when its pass has another number of rows. In float32 on an H200 that made a graph-captured step (its
rows padded to the bucket) differ from the eager path by 5e-6 on the tiny test models, and a token
tree's node from its chain (`tests/test_static_step.py`, `tests/test_token_tree.py`). Here each output
element is summed by one program over K in BLOCK_K chunks, in order, and every tile of BLOCK_M rows
runs the same instructions whatever M is: a row's output is the same alone or among 1,000.

Used for float32 layers on CUDA (`use_invariant_linears`). In bfloat16 the kernels cuBLAS picks
measured invariant at the 1.5B's shapes over 1..64 rows (a token's logits alone, among 8 verified
tokens and among 64 rows, the same bits on an H200: `tests/test_cuda_row_invariance.py`), so bf16
keeps them. Without a GPU the kernel
runs in Triton's interpreter (TRITON_INTERPRET=1), which the tests use.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: their linear layers are row-independent already (oneDNN, native kernels)
    triton = None

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32  # fixed: a row's reduction order never changes with M


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        inner = tl.arange(0, BLOCK_K)  # [BK]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, K, BLOCK_K):  # K in order
            ks = k + inner
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                        other=0.0)  # [BM, BK]
            w = tl.load(w_ptr + columns[None, :] * stride_w + ks[:, None],
                        mask=(columns[None, :] < N) & (ks[:, None] < K), other=0.0)  # [BK, BN]
            acc = tl.dot(x, w, acc, input_precision="ieee")
        if HAS_BIAS:
            acc += tl.load(bias_ptr + columns, mask=columns < N, other=0.0)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_out + columns[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (columns[None, :] < N))


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T + bias [N]: [..., N], each row computed alone."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows, (columns, inner) = flat.shape[0], weight.shape
    out = torch.empty(rows, columns, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(columns, BLOCK_N))
    _linear_kernel[grid](flat, weight, bias if bias is not None else weight, out, rows, columns, inner, flat.stride(0),
                         weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                         BLOCK_K=BLOCK_K)
    return out.view(*x.shape[:-1], columns)


class InvariantLinear(nn.Module):
    """An `nn.Linear`'s weight and bias (the same parameters, shared where tied), multiplied by the kernel."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)


def use_invariant_linears(model: nn.Module) -> int:
    """Replace every float32 CUDA `nn.Linear` in `model` by an `InvariantLinear`; returns how many."""
    if triton is None:
        return 0
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.is_cuda and child.weight.dtype == torch.float32:
                setattr(module, name, InvariantLinear(child))
                replaced += 1
    return replaced
