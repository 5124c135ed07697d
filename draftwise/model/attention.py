"""Grouped-query self-attention over a KV cache.

With a cache (every engine pass), the cache view writes the new keys and values and computes the
attention (`draftwise/cache/attention_backend.py`: on the CPU one batch-invariant native call per
layer, so verifying k tokens computes bit for bit what k one-token steps compute). Without one (a
whole sequence at once, as reference checks run it), one causal SDPA call.

Per model: QK-norm (Qwen3, Gemma 3: an RMSNorm over each head's query and key before RoPE), the
scores' scale (Gemma's query_pre_attn_scalar), and sliding layers (Gemma 3: a query at position p
sees keys p - window + 1 .. p).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from draftwise.model.config import ModelConfig
from draftwise.model.layers import RMSNorm, apply_rotary
from draftwise.model.part_changes import TracksPartChanges


class KVCacheView(Protocol):
    """What attention needs of a paged KV cache for one forward pass (`draftwise.cache` provides it)."""

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the new keys/values [B, Hkv, S, D] of this pass's rows."""

    def attend(self, layer: int, q: torch.Tensor, positions: torch.Tensor, *, scale: float,
               window: int = 0) -> torch.Tensor:
        """Causal attention of q [B, Hq, S, D] at positions [B, S] over the layer's keys (the last
        `window` of them up to each query's position; 0: all), scores scaled by `scale`: [B, Hq, S, D]."""

    # Optional: kernel_plan() -> native_decoder.KernelPlan | None, the pass for native decoder layers
    # (a view without it, or answering None, has every layer run in Python); write_target(layer) ->
    # (keys, values [slots, Hkv, D], slots [N]) | None, the layer's storage and the pass's slots, for a
    # kernel that stores the new keys and values as it computes them (then `write` is not called).


class Attention(TracksPartChanges):
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
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.scale = config.attention_scale
        self.window = config.sliding_window if config.is_sliding(layer_index) else 0

    def forward(
        self,
        x: torch.Tensor,  # [B, S, H]
        positions: torch.Tensor,  # [B, S]
        cos: torch.Tensor,  # [B, 1, S, D]
        sin: torch.Tensor,  # [B, 1, S, D]
        cache: KVCacheView | None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.qkv_proj(x)  # [B, S, (Hq + 2 Hkv) D]
        v = qkv[..., -self.split_sizes[2]:].view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        one_kernel = self._one_kernel_rotation(qkv, cos) if cache is not None else None
        stored = False  # whether the new keys and values are in the cache already
        if one_kernel is not None:  # the GPU's: 1 kernel instead of 12 (and the cache write's, where it takes it)
            cache_slots = self._cache_slots(cache, qkv, one_kernel)
            q, k = one_kernel.rotate_queries_and_keys(qkv, cos, sin, self.num_heads, self.num_kv_heads,
                                                      self.head_dim, cache_slots)  # [B*S, Hq, D], [B*S, Hkv, D]
            q = q.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)  # [B, Hq, S, D]
            stored = k is None
            if not stored:
                k = k.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
        else:
            q, k, _ = qkv.split(self.split_sizes, dim=-1)
            q = q.view(batch, seq, self.num_heads, self.head_dim)  # [B, S, Hq, D]
            k = k.view(batch, seq, self.num_kv_heads, self.head_dim)  # [B, S, Hkv, D]
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, Hq, S, D], [B, Hkv, S, D]
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)

        if cache is None:
            key_positions = positions[:, None, None, :]  # [B, 1, 1, S]
            query_positions = positions[:, None, :, None]  # [B, 1, S, 1]
            mask = key_positions <= query_positions  # [B, 1, S, S]
            if self.window:
                mask &= key_positions > query_positions - self.window
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True,
                                                 scale=self.scale)  # [B, Hq, S, D]
        else:
            if not stored:
                cache.write(self.layer_index, k, v)
            out = cache.attend(self.layer_index, q, positions, scale=self.scale, window=self.window)  # [B, Hq, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def _one_kernel_rotation(self, qkv: torch.Tensor, cos: torch.Tensor):
        """On CUDA, where Triton is: `model/triton_rotary.py`, which rotates the queries and keys in one
        kernel (the same bits as `apply_rotary`'s ops, in the token-major layout the cache and attention
        kernels read); else None."""
        if not qkv.is_cuda or self.qk_norm or cos.dtype != qkv.dtype or self.head_dim & (self.head_dim - 1):
            return None
        from draftwise.model import triton_rotary  # (Triton only where there is a GPU: ~70 MB resident)
        return triton_rotary if triton_rotary.available() else None

    def _cache_slots(self, cache: KVCacheView, qkv: torch.Tensor, one_kernel):
        """(keys, values [slots, Hkv, D], slots [N]) where the rotation kernel can store this pass's keys
        and values itself: a view that offers its storage (`write_target`) in a layout the kernel
        takes; else None (the view writes them)."""
        target = getattr(cache, "write_target", None)
        target = None if target is None else target(self.layer_index)
        if target is None or not one_kernel.fits_cache(target[0], target[1], qkv):
            return None
        return target
