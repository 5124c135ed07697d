"""Mixture-of-experts feed-forward blocks (Mixtral's, Qwen2-MoE's), as transformers computes them.

A router scores every expert per token; the top k are kept, their softmax weights renormalised to
sum to one where the model says so (Mixtral always; Qwen2-MoE with `norm_topk_prob`); each chosen
expert (a SwiGLU) runs on the tokens routed to it and its output, times its weight, is added to
theirs. Qwen2-MoE adds a shared expert on every token, gated by sigmoid(shared_expert_gate(x)).

Row independence: a token's experts depend on its own logits only, each expert's matrix products
give a row the same bits however many rows share them (the engine's kernels), and the outputs are
summed in expert order whatever the batch, and the shared expert's gate is computed so that its
bits do not depend on the batch either (`rowwise_sigmoid`), so a token's result never depends on
its neighbours: verifying k drafted tokens computes what k steps compute.
"""

from __future__ import annotations

import torch
from torch import nn

from draftwise.model.layers import SwiGLU


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, expert_size: int, num_experts: int, top_k: int, normalize: bool,
                 shared_expert_size: int = 0) -> None:
        super().__init__()
        self.top_k, self.normalize = top_k, normalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(SwiGLU(hidden_size, expert_size) for _ in range(num_experts))
        self.shared_expert = SwiGLU(hidden_size, shared_expert_size) if shared_expert_size else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_expert_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, H]
        weights = torch.softmax(self.gate(flat).float(), dim=-1)  # [N, E]
        top_weights, top_experts = weights.topk(self.top_k, dim=-1)  # [N, k]
        if self.normalize:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        top_weights = top_weights.to(flat.dtype)
        out = torch.zeros_like(flat)  # [N, H]
        for expert in top_experts.unique().tolist():  # (in expert order)
            rows, slot = (top_experts == expert).nonzero(as_tuple=True)  # tokens routed here
            routed = self.experts[expert](flat[rows]) * top_weights[rows, slot, None]  # [n, H]
            out.index_add_(0, rows, routed)
        if self.shared_expert is not None:
            out = out + rowwise_sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(shape)


LANES = 64  # a whole number of PyTorch's CPU vector steps (AVX2: 16 floats, AVX-512: 32)
ONE_THREAD_ROWS = 512  # 512 x 64 values: under ATen's grain (32,768), so computed by one thread


def rowwise_sigmoid(gate: torch.Tensor) -> torch.Tensor:
    """sigmoid of gate [N, 1], a row's value the same whatever N. PyTorch's CPU loops compute a
    tensor's whole vector steps with vector code and its tail with scalar code, which round
    differently (AVX2: 158 of 4,000 values differ between a [4000, 1] call and one value at a time),
    so a token's gate would depend on how many tokens share its pass. Here every row fills whole
    vector steps of its own (its value repeated), in pieces one thread computes."""
    wide = gate.expand(-1, LANES).contiguous()  # [N, 64]
    return torch.cat([torch.sigmoid(piece) for piece in wide.split(ONE_THREAD_ROWS)])[:, :1]  # [N, 1]
