"""Weight-only int4 and int8 layers on CUDA, through PyTorch's own kernels.

The CPU's layers (`linear.py`) run this project's native kernels; on a GPU the same integers go to
the kernels PyTorch ships:
  - int4: tinygemm (`_convert_weight_to_int4pack`, `_weight_int4pack_mm`; NVIDIA compute capability
    8.0 and later): bf16 activations, groups of 32 inputs, each with a bf16 scale and zero, weight =
    (q - 8) * scale + zero. The CPU's integers carry over as they are (weight = scale * q - minimum,
    so zero = 8 * scale - minimum); only the scales round, to bf16 (a GGUF Q4_K group's d * sub_scale
    keeps 8 of its bits, where the CPU's Q4_K kernel keeps them all).
  - int8 (one scale per output channel): `_weight_int8pack_mm` where this torch build has it for
    CUDA, else the int8 weight cast to bf16 for a cuBLAS product and the scale applied after (the
    memory of int8 at rest, not its speed: the cast is a bf16 copy of the weight a call).
Rows stay independent only if the kernel computes each row the same way whatever the number of rows;
`tests/test_cuda_quantized.py` checks that on a GPU (a token's output alone, among 8 and among 64 rows).
"""

from __future__ import annotations

import torch
from torch import nn

from draftwise.quant.int8_rows import quantize_int8_rows

GROUP = 32  # inputs sharing a scale and a zero (the CPU's int4 group)
INNER_K_TILES = (8, 4, 2)  # tinygemm's packing: the largest whose 16-input tiles divide K


class CudaUnsupportedError(ValueError):
    """This GPU or torch build has no kernel for the format."""


def int4_supported(device: torch.device) -> str | None:
    """Why int4 cannot run on `device` (None: it can)."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int4pack_mm", "CUDA"):
        return "this torch build has no CUDA int4 kernel (_weight_int4pack_mm)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0) and torch.version.hip is None:
        return f"PyTorch's int4 kernel needs compute capability 8.0 or later; this GPU has {major}.{minor}"
    return None


def inner_k_tiles(in_features: int) -> int | None:
    """tinygemm's inner K tiles for K inputs (None: K does not fit its tiles)."""
    return next((tiles for tiles in INNER_K_TILES if in_features % (16 * tiles) == 0), None)


def int4_fits(out_features: int, in_features: int) -> bool:
    """Whether tinygemm takes a weight of this shape (its N in 8-channel tiles, its K in groups and tiles)."""
    return out_features % 8 == 0 and in_features % GROUP == 0 and inner_k_tiles(in_features) is not None


class CudaInt4Linear(nn.Module):
    def __init__(self, quants: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor,
                 bias: torch.Tensor | None, device: torch.device) -> None:
        """quants uint8 [N, K] in 0..15; scales, minimums float32 [N, K/32]; weight = scale * q - minimum."""
        super().__init__()
        self.out_features, self.in_features = quants.shape
        if not int4_fits(self.out_features, self.in_features):
            raise CudaUnsupportedError(f"PyTorch's int4 kernel takes no {self.out_features}x{self.in_features} weight")
        quants = quants.to(device=device, dtype=torch.uint8)
        pairs = (quants[:, ::2] << 4) | quants[:, 1::2]  # [N, K/2]: the even input in the high nibble
        self.packed_weight = torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles(self.in_features))
        scales = scales.to(device=device, dtype=torch.float32)  # [N, K/32]
        minimums = minimums.to(device=device, dtype=torch.float32)
        zeros = 8 * scales - minimums  # (q - 8) * scale + zero == scale * q - minimum
        pairs_of = torch.stack([scales.t(), zeros.t()], dim=-1)  # [K/32, N, 2]
        self.scales_and_zeros = pairs_of.to(torch.bfloat16).contiguous()
        self.bias = None if bias is None else bias.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # [M, K]
        out = torch.ops.aten._weight_int4pack_mm(flat, self.packed_weight, GROUP, self.scales_and_zeros)  # [M, N]
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight [N, K] the kernel computes with (or rows `rows` [R] of it: [R, K]), read back
        through the kernel (the packing is tinygemm's own)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed_weight.device)  # [K, K]
        weight = torch.ops.aten._weight_int4pack_mm(eye, self.packed_weight, GROUP, self.scales_and_zeros).t().float()
        return (weight if rows is None else weight[rows.to(weight.device)]).contiguous()


class CudaInt8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """weight float [N, K] on the GPU: quantized here, symmetric, one scale per output channel."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight_int8, self.scales = quantize_int8_rows(weight)  # int8 [N, K], bf16 [N]
        self.bias = bias
        self.packed_kernel = torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", "CUDA")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # [M, K]
        if self.packed_kernel:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)  # [M, N]
        else:  # (int8 values are exact in bf16)
            out = torch.nn.functional.linear(flat, self.weight_int8.to(torch.bfloat16)) * self.scales  # [M, N]
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        every = slice(None) if rows is None else rows.to(self.weight_int8.device)
        return self.weight_int8[every].float() * self.scales.float()[every, None]
