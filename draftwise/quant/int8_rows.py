"""Symmetric int8 quantization with one scale per output row, as the CPU and CUDA int8 layers keep it."""

from __future__ import annotations

import torch


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight float [N, K] -> (int8 weights [N, K], bf16 scales [N]); weight ~= int8 * scale.

    PyTorch's int8 kernels take bf16 scales: each scale is rounded up to bf16 first and the weight
    quantized against that, so the error stays within half a step (rounding the scale afterwards would
    add up to 127x its rounding error)."""
    weight = weight.float()
    scales = ((weight.abs().amax(dim=1) / 127).clamp(min=1e-12) * (1 + 2 ** -8)).to(torch.bfloat16)  # [N]
    quants = torch.round(weight / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
    return quants, scales
