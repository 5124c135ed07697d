"""A linear layer holding GGUF Q6_K weights as the file does: weight = d * sc * (q - 32), per
super-block of 256 inputs and sub-block of 16 (`q6k.py`), multiplied by int8-quantized activations
with VNNI byte dot products (q8_matmul.cpp's `q6k`; 6.5625 bits a weight streamed, against 8 for
the int8 re-quantization it replaces, which also rounded the file's weights)."""

from __future__ import annotations

import torch
from torch import nn

from draftwise.model.native_decoder import NativeLinear
from draftwise.model.prompt_pass import in_prompt_pass
from draftwise.quant import native_ops
from draftwise.quant.linear import detached, float_bias
from draftwise.quant.native import kernels as native_kernels, prompt_kernels
from draftwise.quant.superblock_strips import (SUPER, kernel_available, pack_q6k_strips, rows_of_strips,
                                               unpack_q6k_strips)


def q6k_kernel_available(in_features: int) -> bool:
    """Whether this machine has the Q6_K kernel for a layer of this many inputs."""
    return kernel_available("q6k_matmul_q8", in_features)


class Q6KLinear(nn.Module):
    def __init__(self, q: torch.Tensor, sub_scales: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None) -> None:
        """q uint8 [N, K] in 0..63, sub_scales int8 [N, K/16], d fp16 [N, K/256]."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.bias = bias
        self.kernels = native_kernels()
        self.strips = pack_q6k_strips(q, sub_scales, d)  # uint8 [N/16, K/256, 3360]

    @classmethod
    def from_packed(cls, state: dict[str, torch.Tensor], bias: torch.Tensor | None) -> "Q6KLinear":
        n, k = (int(v) for v in state["shape"])
        if not q6k_kernel_available(k):
            raise ValueError("packed for the Q6_K kernel, which is not available here")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.out_features, layer.in_features, layer.bias = n, k, bias
        layer.kernels, layer.strips = native_kernels(), state["q6k_strips"]
        return layer

    def packed_state(self) -> dict[str, torch.Tensor]:
        return {"q6k_strips": self.strips, "shape": torch.tensor([self.out_features, self.in_features])}

    @property
    def has_prompt_kernel(self) -> bool:
        """Whether prompt tokens take a kernel of their own here (`model/prompt_pass.py`)."""
        return prompt_kernels() is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()  # [M, K], quantized per group by the kernel
        if in_prompt_pass() and self.has_prompt_kernel:
            out = prompt_kernels().q6k_matmul_amx(flat, self.strips, self.out_features).to(x.dtype)  # [M, N]
        else:
            out = native_ops.q6k_q8(flat, self.strips, self.out_features).to(x.dtype)  # [M, N]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def native_linear(self) -> NativeLinear | None:
        """This layer's native matmul, for native decoder layers."""
        if not float_bias(self.bias):
            return None
        return NativeLinear("q6k_q8", self.kernels.entry_points["q6k_matmul_q8"], (self.strips,), detached(self.bias),
                            self.out_features)

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight [N, K] this layer computes with (or its rows `rows` [R] only: [R, K])."""
        if rows is not None:  # the strips holding the rows, a few at a time
            return rows_of_strips(rows, lambda strips, n: _weight(self.strips[strips], n, self.in_features))
        return _weight(self.strips, self.out_features, self.in_features)


def _weight(strips: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The float weight [n, K] of Q6_K strips [n/16, K/256, bytes]."""
    q, sub_scales, d = unpack_q6k_strips(strips, n, k)
    return d.float().repeat_interleave(SUPER, 1) * sub_scales.float().repeat_interleave(16, 1) * (q.float() - 32)
