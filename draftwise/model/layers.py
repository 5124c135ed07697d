"""Building blocks of a decoder: RMSNorm (and the residual add before it), rotary embedding, the gated
MLP (SwiGLU, or GeGLU with Gemma's tanh-approximated GELU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftwise.model import native_layer_ops
from draftwise.model.part_changes import TracksPartChanges
from draftwise.model.rope import cos_sin, inverse_frequencies


class RMSNorm(TracksPartChanges):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.weight.dtype == x.dtype:
            from draftwise.model import triton_rmsnorm  # (Triton only where there is a GPU: ~70 MB resident)
            if triton_rmsnorm.available():
                return triton_rmsnorm.rms_norm(x, self.weight, self.eps)  # batch-invariant on the GPU
        if native_layer_ops.usable(x) and self.weight.dtype == x.dtype and x.shape[-1] % 16 == 0:  # one call on the CPU
            flat = x.reshape(-1, x.shape[-1]).contiguous()  # [N, H]
            return native_layer_ops.layer_ops().rms_norm(flat, self.weight.detach(), self.eps).view(x.shape)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def add_and_norm(x: torch.Tensor, delta: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """x + delta [..., H], and `norm` of it: on the GPU one kernel (`triton_rmsnorm.add_rms_norm`, the
    bits of the add, then the norm's kernel), elsewhere the two ops."""
    if x.is_cuda and norm.weight.dtype == x.dtype == delta.dtype:
        from draftwise.model import triton_rmsnorm  # (Triton only where there is a GPU: ~70 MB resident)
        if triton_rmsnorm.available():
            return triton_rmsnorm.add_rms_norm(x, delta, norm.weight, norm.eps)
    x = x + delta
    return x, norm(x)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, S, D] for positions [B, S] with plain RoPE (the half-split layout of Hugging
    Face Llama); a model's own, scaled as its config says, is `Transformer.rotary`."""
    inv_freq, factor = inverse_frequencies(head_dim, theta, None)
    return cos_sin(positions, inv_freq, factor, dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, S, D] by the position angles."""
    if native_layer_ops.usable(x) and cos.dtype == x.dtype and x.stride(-1) == 1:
        return native_layer_ops.layer_ops().apply_rotary(x, cos, sin)  # [B, H, S, D] contiguous
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class SwiGLU(TracksPartChanges):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matrix product; act is silu
    (SwiGLU) or, with activation "gelu_tanh", GELU's tanh approximation (Gemma's GeGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [..., 2I]
        if self.activation == "gelu_tanh":
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        if gate_up.is_cuda:
            from draftwise.model import triton_silu_mul  # (Triton only where there is a GPU: ~70 MB resident)
            if triton_silu_mul.available():
                return self.down_proj(triton_silu_mul.silu_mul(gate_up))  # one kernel instead of two
        if native_layer_ops.usable(gate_up):
            flat = gate_up.reshape(-1, 2 * self.intermediate_size).contiguous()  # [N, 2I]
            hidden = native_layer_ops.layer_ops().silu_mul(flat).view(*gate_up.shape[:-1], self.intermediate_size)
            return self.down_proj(hidden)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
