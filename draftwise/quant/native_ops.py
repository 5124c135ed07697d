"""The native low-bit matmuls as PyTorch custom ops, so that `torch.compile(fullgraph=True)` traces
through them (a plain extension call would break the graph); eager code calls the extension
directly and skips the dispatcher's cost."""

from __future__ import annotations

import torch

from draftwise.quant.native import kernels


@torch.library.custom_op("draftwise::int4_matmul", mutates_args=())
def int4_matmul(x: torch.Tensor, nibbles: torch.Tensor, scale_min: torch.Tensor, out_features: int) -> torch.Tensor:
    """x bf16 [M, K] times an int4 weight in the native layout: float32 [M, out_features]."""
    return kernels().int4_matmul(x, nibbles, scale_min, out_features)


@int4_matmul.register_fake
def _(x: torch.Tensor, nibbles: torch.Tensor, scale_min: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features, dtype=torch.float32)


@torch.library.custom_op("draftwise::int8_matmul", mutates_args=())
def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x bf16 [M, K] times int8 weight [N, K] with per-channel float scales [N]: float32 [M, N]."""
    return kernels().int8_matmul(x, weight, scales)


@int8_matmul.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


@torch.library.custom_op("draftwise::int8_matmul_q8", mutates_args=())
def int8_matmul_q8(x: torch.Tensor, strips: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """x float32 [M, K] (quantized to int8 per group of 32 inside) times an int8 weight in strips with
    per-channel float scales [N padded to 16]: float32 [M, out_features]."""
    return kernels().int8_matmul_q8(x, strips, scales, out_features)


@int8_matmul_q8.register_fake
def _(x: torch.Tensor, strips: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features, dtype=torch.float32)


def _strips_matmul(kernel: str, weights: str):
    """The custom op `draftwise::<kernel>` for a native kernel taking (x, strips, out_features): x
    float32 [M, K] (quantized to int8 per group of 32 inside) times `weights` in strips, float32
    [M, out_features]; and the function the layers call (the op while compiling, else the kernel)."""

    def matmul(x: torch.Tensor, strips: torch.Tensor, out_features: int) -> torch.Tensor:
        return getattr(kernels(), kernel)(x, strips, out_features)

    matmul.__doc__ = f"x float32 [M, K] times {weights} in strips: float32 [M, out_features]."
    op = torch.library.custom_op(f"draftwise::{kernel}", matmul, mutates_args=())

    @op.register_fake
    def _(x: torch.Tensor, strips: torch.Tensor, out_features: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], out_features, dtype=torch.float32)

    def call(x: torch.Tensor, strips: torch.Tensor, out_features: int) -> torch.Tensor:
        return op(x, strips, out_features) if torch.compiler.is_compiling() else matmul(x, strips, out_features)

    return op, call


int4_matmul_q8, int4_q8 = _strips_matmul("int4_matmul_q8", "int4 weights")
q4k_matmul_q8, q4k_q8 = _strips_matmul("q4k_matmul_q8", "GGUF Q4_K weights")
q6k_matmul_q8, q6k_q8 = _strips_matmul("q6k_matmul_q8", "GGUF Q6_K weights")


def int4(x: torch.Tensor, nibbles: torch.Tensor, scale_min: torch.Tensor, out_features: int) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return int4_matmul(x, nibbles, scale_min, out_features)
    return kernels().int4_matmul(x, nibbles, scale_min, out_features)


def int8(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return int8_matmul(x, weight, scales)
    return kernels().int8_matmul(x, weight, scales)


def int8_q8(x: torch.Tensor, strips: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return int8_matmul_q8(x, strips, scales, out_features)
    return kernels().int8_matmul_q8(x, strips, scales, out_features)

