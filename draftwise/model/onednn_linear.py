"""Linear layers with weights prepacked for oneDNN: the fast fp32 path on CPUs.

Measured on this project's 2-core machine (a 9728x896 fp32 weight): `F.linear` takes 2.3 ms for
one row and grows linearly to ~4.5 ms at 3-4 rows, while oneDNN with a prepacked weight takes
0.9 ms for one row and 2.0 ms for eight. Decoding reads every weight once per step, and
speculative verification runs k+1 rows, so this curve sets both plain speed and what
speculation can gain on a CPU.

Batch invariance: a row's output must not depend on how many rows share the call (or greedy
speculation would differ from plain decoding at near-ties). oneDNN's GEMM results agree for every
M from 2 to 64; only M = 1 takes another kernel (`draftwise divergence --quantization none` found
it), so a single row is computed as two.
"""

from __future__ import annotations

import torch
from torch import nn


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDNNLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed_weight = linear.weight.detach().to_mkldnn()  # opaque oneDNN layout, [out, in]
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def native_linear(self) -> tuple:
        """For native decoder layers (`native_decoder.NativeLinear`'s fields), which call the same op."""
        return "onednn", None, (self.packed_weight,), self.bias, self.out_features

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight [out, in] (or its rows `rows` [R]: [R, in]) read back from oneDNN's layout
        (the quantized layers' name for it: a trimmed LM head takes rows of any layer so)."""
        weight = self.packed_weight.to_dense()
        return weight if rows is None else weight[rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, in]
        if rows.shape[0] == 1:
            # oneDNN computes one row with its GEMV kernel, which rounds differently from its GEMM:
            # then verifying k tokens would not compute what k one-token steps compute. A single
            # row goes through the GEMM as two (itself and a copy); M >= 2 all agree bit for bit.
            rows = rows.expand(2, -1)
        if torch.compiler.is_compiling():  # the packed weight is opaque to the compiler: call it as one op
            out = _onednn_linear(rows, self.packed_weight, self.bias, self.out_features)
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out[:x[..., 0].numel()].reshape(*x.shape[:-1], self.out_features)


@torch.library.custom_op("draftwise::onednn_linear", mutates_args=())
def _onednn_linear(rows: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int) -> torch.Tensor:
    """rows [M, in] times a prepacked weight: [M, out_features]."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed_weight, bias, "none", [], "")


@_onednn_linear.register_fake
def _(rows, packed_weight, bias, out_features):
    return rows.new_empty(rows.shape[0], out_features)


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every fp32 CPU `nn.Linear` in `model` by a `OneDNNLinear`; returns how many."""
    if not onednn_available():
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32
    ]
    for parent, name, child in targets:
        setattr(parent, name, OneDNNLinear(child))
    return len(targets)
