"""A decoder layer as one native call on the CPU (kernels/decoder_layer.cpp).

The Python layer calls a handful of native kernels per layer (norms, matmuls, rotary, attention) and
~100 small tensor operations between them; on two cores those cost ~7 ms of a 1.5B model's ~50 ms
step and ~5 ms of a 0.5B draft model's ~18 ms token. The native layer calls the very same compiled
kernels (each extension hands over its entry points as capsules) on the same tensors in the same
order, so it computes the same bits (tested) without that overhead.

A layer runs natively when everything it computes has such a kernel: a plain decoder layer (not a
mixture of experts, not Gemma's sandwich norms or GELU), float32 activations on the CPU, native
RMSNorm/rotary/SiLU (hidden size and, with QK-norm, head_dim multiples of 16), each linear either a
float `nn.Linear` or a quantized layer that describes its native matmul (`native_linear()`), and a
pass over a cache whose attention is the native kernel (`kernel_plan()`). Otherwise the Python layer
runs, for every pass of that layer alike: which path a layer takes never depends on the pass, so
prefill, decoding steps and verification keep computing the same arithmetic.
DRAFTWISE_NATIVE_LAYERS=0 turns the native layers off.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from draftwise import native
from draftwise.model import native_layer_ops

NATIVE_LAYERS_ENV = "DRAFTWISE_NATIVE_LAYERS"
SOURCE = Path(__file__).resolve().parent / "kernels" / "decoder_layer.cpp"
BUILDS = (  # no intrinsics of its own: one build per ISA only so that it follows DRAFTWISE_NATIVE_ISA as the kernels do
    native.Build("avx512", (SOURCE,), ("-O3",), ("avx512f", "fma")),
    native.Build("avx2", (SOURCE,), ("-O3",), ("avx2", "fma")),
)


class NativeLinear(NamedTuple):
    """How a linear layer computes, for the native layer: `kind` is "int4_q8", "int8_q8", "int4_bf16",
    "int8_bf16", "q4k_q8" or "q6k_q8" (a quantized layer: `function` its matmul's entry point, `tensors` its packed weight
    and scales), "onednn" (`OneDNNLinear`: tensors = (prepacked weight,)) or "float" (an `nn.Linear`:
    tensors = (weight,))."""
    kind: str
    function: Any
    tensors: tuple[torch.Tensor, ...]
    bias: torch.Tensor | None
    out_features: int


class KernelPlan(NamedTuple):
    """What a pass over the paged KV cache reads and writes, for the native layer (`KVCacheView.kernel_plan`):
    the attention kernel's entry point, the storage, each new token's slot, the block tables, each
    query's row and position, and a token tree's paths (empty tensors for chains)."""
    attention: Any
    keys: torch.Tensor  # [L, slots, Hkv, D]
    values: torch.Tensor  # [L, slots, Hkv, D]
    write_slots: torch.Tensor  # [B*S]
    block_tables: torch.Tensor  # [B, W]
    block_size: int
    query_rows: torch.Tensor  # [B*S]
    positions: torch.Tensor  # [B*S]
    path_start: torch.Tensor  # [B*S] or [0]
    path: torch.Tensor  # [B*S, T] or [0]


def source_digest() -> str:
    """Names the build this machine uses (cost profiles measured without it are not its)."""
    return native.chosen_digest(BUILDS)


def wanted() -> bool:
    """Whether a model built now runs its layers natively where it can (DRAFTWISE_NATIVE_LAYERS=0: never)."""
    return os.environ.get(NATIVE_LAYERS_ENV, "1") != "0"


@cache
def decoder_module():
    """The compiled extension, or None where it cannot be had."""
    if native_layer_ops.layer_ops() is None:
        return None
    return native.build("decoder_layer", BUILDS)


def native_pass(plan: KernelPlan | None):
    """The native form of a pass's plan, or None (no plan: the cache's attention is not the native kernel)."""
    module = decoder_module()
    if plan is None or module is None:
        return None
    return module.Pass(*plan)


def float_linear(linear: nn.Module) -> NativeLinear | None:
    if type(linear) is not nn.Linear or linear.weight.dtype != torch.float32 or linear.weight.device.type != "cpu":
        return None
    bias = None if linear.bias is None else linear.bias.detach()
    return NativeLinear("float", None, (linear.weight.detach(),), bias, linear.out_features)


def describe_linear(linear: nn.Module) -> NativeLinear | None:
    if type(linear) is nn.Linear:
        return float_linear(linear)
    describe = getattr(linear, "native_linear", None)
    described = None if describe is None else describe()
    return None if described is None else NativeLinear(*described)


def build_layer(layer: nn.Module, config) -> Any | None:
    """The native form of a plain decoder layer (its `input_layernorm`, `self_attn`,
    `post_attention_layernorm`, `mlp`), or None where some part of it has no native kernel."""
    module = decoder_module()
    attention, mlp = layer.self_attn, layer.mlp
    if module is None or not hasattr(mlp, "gate_up_proj") or getattr(mlp, "activation", None) != "silu":
        return None
    norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    if attention.qk_norm:
        if attention.head_dim % 16:
            return None
        norms += [attention.q_norm.weight, attention.k_norm.weight]
    if config.hidden_size % 16 or any(w.dtype != torch.float32 or w.device.type != "cpu" for w in norms):
        return None
    linears = [describe_linear(m) for m in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(linear is None for linear in linears):
        return None
    norms = [w.detach() for w in norms]
    q_norm, k_norm = (norms[2], norms[3]) if attention.qk_norm else (None, None)
    return module.Layer(native_layer_ops.layer_ops().entry_points, norms[0], norms[1], q_norm, k_norm,
                        float(layer.input_layernorm.eps), *(module.Linear(*linear) for linear in linears),
                        attention.layer_index, attention.num_heads, attention.num_kv_heads, attention.head_dim,
                        float(attention.scale), attention.window)
