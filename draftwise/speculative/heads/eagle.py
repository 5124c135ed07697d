"""EAGLE (Li et al. 2024): one decoder layer that drafts from the target's features, on its own.

The target's feature f_t at position t (its last hidden state after the final norm, what its LM
head reads) produced token t + 1. The head reads the pair (f_t, token t + 1) and predicts the
next feature, whose LM-head row scores give token t + 2:

    g_{t+1} = Layer(fc([E(x_{t+1}) ; f_t]))      E: the target's embedding, fc: [2H -> H]
    logits  = W_lm . g_{t+1}                     W_lm: the target's LM head rows (frozen, kept ids)

A draft feeds its own predictions back: (g_{t+1}, d_1) -> g_{t+2} -> d_2, and so on. Its
attention runs over the head's own cache of keys and values, one entry per position, computed from
the target's true features once they are known (drafted entries are dropped after each draft).

The layer is a Llama decoder layer (grouped-query attention with rotary embedding, SwiGLU MLP)
whose MLP width is the head's own choice; EAGLE-1 drops the first norm (its input is fc's output).
Written with plain torch ops so that it trains on autograd and serves with the same code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftwise.model.layers import rotary_cos_sin
from draftwise.speculative.vocab_trim import rows_dtype


@dataclass(frozen=True, slots=True)
class EagleShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the head's MLP width (the target's or narrower: cost per draft token)
    rope_theta: float
    rms_norm_eps: float
    attention_bias: bool

    def as_dict(self) -> dict:
        return asdict(self)


class HeadKV:
    """One request's keys and values [Hkv, L, D] in the head's layer, grown by doubling."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.keys = torch.empty(num_kv_heads, 64, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.length = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:  # [Hkv, n, D]
        needed = self.length + keys.shape[1]
        if needed > self.keys.shape[1]:
            capacity = max(needed, 2 * self.keys.shape[1])
            grown_k = self.keys.new_empty(self.keys.shape[0], capacity, self.keys.shape[2])
            grown_v = torch.empty_like(grown_k)
            grown_k[:, :self.length] = self.keys[:, :self.length]
            grown_v[:, :self.length] = self.values[:, :self.length]
            self.keys, self.values = grown_k, grown_v
        self.keys[:, self.length:needed] = keys
        self.values[:, self.length:needed] = values
        self.length = needed

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def prefix(self, length: int) -> "HeadKV":
        """A copy holding the first `length` positions (to draft from there without touching this one)."""
        copy = HeadKV.__new__(HeadKV)
        copy.keys = self.keys[:, :max(length, 1)].clone()
        copy.values = self.values[:, :max(length, 1)].clone()
        copy.length = min(length, self.length)
        return copy


def appended_and_padded(caches: list[HeadKV], keys: torch.Tensor, values: torch.Tensor):
    """Row r's new keys and values [R, Hkv, 1, D] appended to caches[r]; then every row's cache side by
    side, padded to the longest: keys, values [R, Hkv, L, D] and the mask of real entries [R, 1, 1, L]."""
    for r, cache in enumerate(caches):
        cache.append(keys[r], values[r])
    longest = max(cache.length for cache in caches)
    padded_keys = keys.new_zeros(len(caches), keys.shape[1], longest, keys.shape[3])
    padded_values = torch.zeros_like(padded_keys)
    for r, cache in enumerate(caches):
        padded_keys[r, :, :cache.length] = cache.keys[:, :cache.length]
        padded_values[r, :, :cache.length] = cache.values[:, :cache.length]
    lengths = torch.tensor([cache.length for cache in caches], device=keys.device)
    mask = (torch.arange(longest, device=keys.device)[None] < lengths[:, None])[:, None, None]
    return padded_keys, padded_values, mask


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class EagleHead(nn.Module):
    def __init__(self, shape: EagleShape, kept_ids: torch.Tensor) -> None:
        super().__init__()
        self.shape = shape
        h, d = shape.hidden_size, shape.head_dim
        q_size, kv_size = shape.num_heads * d, shape.num_kv_heads * d
        self.split_sizes = (q_size, kv_size, kv_size)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.qkv_proj = nn.Linear(h, q_size + 2 * kv_size, bias=shape.attention_bias)
        self.o_proj = nn.Linear(q_size, h, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.gate_up_proj = nn.Linear(h, 2 * shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, h, bias=False)
        self.register_buffer("kept_ids", kept_ids.clone())  # [N] vocabulary ids the head scores

    def forward(self, features: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor,
                cache: HeadKV | None = None) -> torch.Tensor:
        """features, embeddings [S, H] of positions [S] (consecutive) -> predicted next features [S, H].

        With a cache: the new keys and values are appended to it and the queries attend everything it
        holds (the earlier positions) plus their own causal prefix. Without one: a causal pass over
        the whole sequence (training)."""
        shape = self.shape
        seq = features.shape[0]
        dtype = self.fc.weight.dtype  # (a head served in bfloat16 takes float32 inputs)
        x = self.fc(torch.cat([embeddings.to(dtype), features.to(dtype)], dim=-1))  # [S, H] (the order vLLM and speculators use)
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(seq, shape.num_heads, shape.head_dim).transpose(0, 1)[None]  # [1, Hq, S, D]
        k = k.view(seq, shape.num_kv_heads, shape.head_dim).transpose(0, 1)[None]  # [1, Hkv, S, D]
        v = v.view(seq, shape.num_kv_heads, shape.head_dim).transpose(0, 1)[None]
        cos, sin = rotary_cos_sin(positions[None], shape.head_dim, shape.rope_theta, x.dtype)  # [1, 1, S, D]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is None:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # [1, Hq, S, D]
        else:
            earlier = cache.length
            cache.append(k[0], v[0])
            keys, values = cache.keys[None, :, :cache.length], cache.values[None, :, :cache.length]  # [1, Hkv, L, D]
            if seq == 1:  # (one query sees every key: no mask)
                attended = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
            else:
                mask = torch.arange(cache.length, device=x.device)[None] <= earlier + torch.arange(seq, device=x.device)[:, None]
                attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        x = x + self.o_proj(attended[0].transpose(0, 1).reshape(seq, -1))
        gate, up = self.gate_up_proj(rms_norm(x, self.post_attention_layernorm, shape.rms_norm_eps)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)  # [S, H]

    def step(self, features: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor,
             caches: list[HeadKV]) -> torch.Tensor:
        """One new position for each of R requests at once: features, embeddings [R, H] at positions
        [R], row r appended to caches[r] and attending all it holds -> predicted features [R, H]."""
        shape = self.shape
        rows = features.shape[0]
        dtype = self.fc.weight.dtype
        x = self.fc(torch.cat([embeddings.to(dtype), features.to(dtype)], dim=-1))  # [R, H]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(rows, shape.num_heads, 1, shape.head_dim)  # [R, Hq, 1, D]
        k = k.view(rows, shape.num_kv_heads, 1, shape.head_dim)  # [R, Hkv, 1, D]
        v = v.view(rows, shape.num_kv_heads, 1, shape.head_dim)
        cos, sin = rotary_cos_sin(positions[:, None], shape.head_dim, shape.rope_theta, x.dtype)  # [R, 1, 1, D]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        keys, values, mask = appended_and_padded(caches, k, v)
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)  # [R, Hq, 1, D]
        x = x + self.o_proj(attended.reshape(rows, -1))
        gate, up = self.gate_up_proj(rms_norm(x, self.post_attention_layernorm, shape.rms_norm_eps)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)  # [R, H]

    def logits(self, predicted: torch.Tensor, lm_rows: nn.Module | torch.Tensor) -> torch.Tensor:
        """[..., N] over the kept ids; lm_rows: [N, H] float rows, or a layer computing x @ rows.T."""
        if isinstance(lm_rows, torch.Tensor):
            return predicted @ lm_rows.t()
        return lm_rows(predicted.to(rows_dtype(lm_rows))).float()[..., :len(self.kept_ids)]

    def new_cache(self) -> HeadKV:
        return HeadKV(self.shape.num_kv_heads, self.shape.head_dim, self.fc.weight.dtype, self.fc.weight.device)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in plain torch ops (the model's native op has no gradient): x [B, H, S, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
