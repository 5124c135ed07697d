"""Weight-only quantized linear layers on PyTorch's packed CPU kernels.

int4: groups of 32 input weights share a scale and a zero point (asymmetric), packed for
`_weight_int4pack_mm_for_cpu`; weight = (q - 8) * scale + zero. int8: one scale per output
channel (symmetric), for `_weight_int8pack_mm`.

Both kernels take bf16 activations and scales: measured on this project's AVX-512 machine for an
8960x1536 layer, one row costs 0.38 ms in bf16 but 11.8 ms (int4) / 5.7 ms (int8) with fp32
activations (a generic path), against 1.48 ms for fp32 weights through oneDNN. So activations are
rounded to bf16 on the way in and the output returns in the caller's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

INT4_GROUP = 32
KERNEL_DTYPE = torch.bfloat16  # activations and scales inside the kernels


class Int4Linear(nn.Module):
    def __init__(self, quants: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        """quants uint8 [N, K] in 0..15; scales, minimums float32 [N, K/32]; weight = scale * q - minimum."""
        super().__init__()
        self.out_features, self.in_features = quants.shape
        self.packed_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(quants.to(torch.int32), 2)
        zeros = 8 * scales - minimums  # (q - 8) * scale + zero == scale * q - minimum
        self.scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(KERNEL_DTYPE).contiguous()  # [K/32, N, 2]
        self.bias = bias

    @classmethod
    def from_packed(cls, packed_weight: torch.Tensor, scales_and_zeros: torch.Tensor,
                    bias: torch.Tensor | None) -> "Int4Linear":
        """Rebuild a layer from `packed_state()` (the packed-weight cache), without repacking."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = scales_and_zeros.shape[0] * INT4_GROUP, scales_and_zeros.shape[1]
        layer.packed_weight, layer.scales_and_zeros, layer.bias = packed_weight, scales_and_zeros, bias
        return layer

    def packed_state(self) -> dict[str, torch.Tensor]:
        return {"packed_weight": self.packed_weight, "scales_and_zeros": self.scales_and_zeros}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed_weight, INT4_GROUP, self.scales_and_zeros)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] this layer computes with (for tests)."""
        eye = torch.eye(self.in_features, dtype=KERNEL_DTYPE)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed_weight, INT4_GROUP, self.scales_and_zeros).t().float().contiguous()


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.float()
        # The kernel takes bf16 scales: round each scale up to bf16 first and quantize against that,
        # so the error stays within half a step (rounding the scale afterwards would add up to 127x its error).
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12) * (1 + 2 ** -8)  # [N]
        self.scales = scales.to(KERNEL_DTYPE)
        self.weight_int8 = torch.round(weight / self.scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        self.bias = bias

    @classmethod
    def from_packed(cls, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> "Int8Linear":
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.out_features, layer.in_features = weight_int8.shape
        layer.weight_int8, layer.scales, layer.bias = weight_int8, scales, bias
        return layer

    def packed_state(self) -> dict[str, torch.Tensor]:
        return {"weight_int8": self.weight_int8, "scales": self.scales}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        return self.weight_int8.float() * self.scales.float()[:, None]


def quantize_int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh asymmetric group-32 quantization of a float weight [N, K] (for tensors not stored as Q4_K)."""
    groups = weight.float().view(weight.shape[0], -1, INT4_GROUP)  # [N, K/32, 32]
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=1e-12)
    quants = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return quants.view(weight.shape), scales, -low  # weight ~ scale * q - minimum with minimum = -low
