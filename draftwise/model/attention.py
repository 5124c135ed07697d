"""Grouped-query self-attention over a KV cache.

Short forwards (decode steps and speculative verification, up to PER_QUERY_MAX queries per row)
attend query by query, each over exactly the keys at positions <= its own, with no mask. That is
the same call, on the same shapes, that one-token-at-a-time decoding makes at that position, so
a query's result does not depend on how many queries or rows share the forward pass (a batched,
masked SDPA call rounds differently). With batch-invariant linear layers, speculative decoding
then computes bit for bit what plain decoding computes.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from draftwise.model.config import ModelConfig
from draftwise.model.layers import apply_rotary

PER_QUERY_MAX = 64


class KVCacheView(Protocol):
    """What attention needs of a paged KV cache for one forward pass (`draftwise.cache` provides it)."""

    host_positions: list[list[int]]  # [B][S]: the position of each new token, on the host

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the new keys/values [B, Hkv, S, D] of this pass's rows."""

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, length, D] of this pass's rows."""


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, S, H]
        positions: torch.Tensor,  # [B, S]
        cos: torch.Tensor,  # [B, 1, S, D]
        sin: torch.Tensor,  # [B, 1, S, D]
        cache: KVCacheView | None,
        kv_length: int,  # keys to attend over: max(position) + 1 in this batch
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)  # [B, Hq, S, D]
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)

        if cache is None:
            key_positions = positions  # [B, T=S]
        else:
            cache.write(self.layer_index, k, v)
            k, v = cache.read(self.layer_index, kv_length)  # [B, Hkv, T, D]
            if seq <= PER_QUERY_MAX:
                out = self._attend_per_query(q, k, v, cache.host_positions)
                return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
            key_positions = torch.arange(kv_length, device=x.device)[None, :]  # [1, T]
        # A query at position p sees every key at a position <= p: causal and rollback-safe.
        mask = key_positions[:, None, None, :] <= positions[:, None, :, None]  # [B, 1, S, T]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # [B, Hq, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    @staticmethod
    def _attend_per_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          host_positions: list[list[int]]) -> torch.Tensor:
        """q [B, Hq, S, D] over k, v [B, Hkv, T, D]: each query alone over keys 0..its position."""
        rows = []
        for b, row_positions in enumerate(host_positions):
            rows.append(torch.cat([
                F.scaled_dot_product_attention(q[b:b + 1, :, s:s + 1], k[b:b + 1, :, :p + 1], v[b:b + 1, :, :p + 1],
                                               enable_gqa=True)
                for s, p in enumerate(row_positions)], dim=2))
        return torch.cat(rows)  # [B, Hq, S, D]
