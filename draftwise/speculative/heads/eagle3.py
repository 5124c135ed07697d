"""EAGLE-3 (Li et al. 2025): one decoder layer drafting from a fusion of the target's low, middle and
high features, trained on its own outputs ("training-time test").

The target's residual streams entering three of its layers (vLLM's and speculators' choice: layers
2, L/2 and L-3 of L) at position t are fused into one feature, and the layer reads it beside the
embedding of the token at t + 1:

    h_t      = fc([a_t ; b_t ; c_t])                                  fc: [3H -> H]
    x        = [RMSNorm_in(E(x_{t+1})) ; RMSNorm_hidden(h_t)]         [2H]: q, k, v read both halves
    u        = h_t + Attn(x)                                          (the residual is the feature)
    g_{t+1}  = u + MLP(RMSNorm_post(u))
    logits   = W_draft . RMSNorm_out(g_{t+1})                         its own LM head over a draft vocabulary

Unlike EAGLE-1 the head does not regress the target's features: g is only ever its own next input.
Drafting feeds it back, (g_{t+1}, d_1) -> g_{t+2} -> d_2, and training does the same (several
unrolled steps per position), so the head learns from the features it will actually read. Its
attention runs over its own cache of keys and values, one entry per position, written from the
fused target features once they are known (drafted entries are dropped after each draft).

The draft vocabulary is a subset of the target's (`kept_ids`, speculators' `d2t`); its LM head is the
head's own (initialised from the target's rows, trained). Written with plain torch ops so that it
trains on autograd and serves with the same code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftwise.model.layers import rotary_cos_sin
from draftwise.speculative.heads.eagle import HeadKV, appended_and_padded, rms_norm, rotate


@dataclass(frozen=True, slots=True)
class Eagle3Shape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    num_aux: int = 3  # fused target layers
    norm_before_residual: bool = False  # speculators' option: the residual is the normed feature

    def as_dict(self) -> dict:
        return asdict(self)


class Eagle3Head(nn.Module):
    def __init__(self, shape: Eagle3Shape, kept_ids: torch.Tensor) -> None:
        super().__init__()
        self.shape = shape
        h, d = shape.hidden_size, shape.head_dim
        q_size, kv_size = shape.num_heads * d, shape.num_kv_heads * d
        self.split_sizes = (q_size, kv_size, kv_size)
        self.fc = nn.Linear(shape.num_aux * h, h, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.qkv_proj = nn.Linear(2 * h, q_size + 2 * kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, h, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.gate_up_proj = nn.Linear(h, 2 * shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, h, bias=False)
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, len(kept_ids), bias=False)
        self.register_buffer("kept_ids", kept_ids.clone())  # [N] the draft vocabulary, as target ids

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [S, 3H] (the target's low, middle, high streams side by side) -> features [S, H]."""
        return self.fc(aux.to(self.dtype))

    def _inputs(self, hidden: torch.Tensor, embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input [S, 2H] and its residual [S, H] from features and next-token embeddings."""
        eps = self.shape.rms_norm_eps
        hidden = hidden.to(self.dtype)
        normed = rms_norm(hidden, self.hidden_norm, eps)
        x = torch.cat([rms_norm(embeddings.to(self.dtype), self.input_layernorm, eps), normed], dim=-1)
        return x, (normed if self.shape.norm_before_residual else hidden)

    def _finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        u = residual + self.o_proj(attended)
        gate, up = self.gate_up_proj(rms_norm(u, self.post_attention_layernorm, self.shape.rms_norm_eps)).chunk(2, dim=-1)
        return u + self.down_proj(F.silu(gate) * up)

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor, rows: int, seq: int):
        """q [rows, Hq, seq, D], k, v [rows, Hkv, seq, D] of x [rows * seq, 2H] at positions [rows, seq]."""
        shape = self.shape
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(rows, seq, shape.num_heads, shape.head_dim).transpose(1, 2)
        k = k.view(rows, seq, shape.num_kv_heads, shape.head_dim).transpose(1, 2)
        v = v.view(rows, seq, shape.num_kv_heads, shape.head_dim).transpose(1, 2)
        cos, sin = rotary_cos_sin(positions, shape.head_dim, shape.rope_theta, x.dtype)  # [rows, 1, seq, D]
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def forward(self, hidden: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor,
                cache: HeadKV | None = None) -> torch.Tensor:
        """hidden, embeddings [S, H] at consecutive positions [S] -> the head's next features [S, H].

        With a cache: the new keys and values are appended and the queries attend everything it
        holds plus their own causal prefix. Without one: a causal pass over the sequence."""
        seq = hidden.shape[0]
        x, residual = self._inputs(hidden, embeddings)
        q, k, v = self._qkv(x, positions[None], 1, seq)
        if cache is None:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            earlier = cache.length
            cache.append(k[0], v[0])
            keys, values = cache.keys[None, :, :cache.length], cache.values[None, :, :cache.length]
            mask = None if seq == 1 else \
                torch.arange(cache.length, device=x.device)[None] <= earlier + torch.arange(seq, device=x.device)[:, None]
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self._finish(residual, attended[0].transpose(0, 1).reshape(seq, -1))  # [S, H]

    def unrolled(self, hidden: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor,
                 earlier: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Training-time test, step j >= 1 over a whole sequence: row t is the head's j-th draft from
        position t, fed its own feature. Its query sees the step-0 keys of positions <= t (the true
        context) and, from every later step i < j, the key at its own row (its own earlier drafts),
        as drafting from t would. earlier: the keys and values [1, Hkv, S, D] of steps 0..j-1.
        Returns the features [S, H] and this step's keys and values."""
        seq = hidden.shape[0]
        x, residual = self._inputs(hidden, embeddings)
        q, k, v = self._qkv(x, positions[None], 1, seq)
        keys = torch.cat([key for key, _ in earlier] + [k], dim=2)  # [1, Hkv, (j+1) S, D]
        values = torch.cat([value for _, value in earlier] + [v], dim=2)
        index = torch.arange(seq, device=x.device)
        causal = index[None] <= index[:, None]  # [S, S] the step-0 block
        diagonal = index[None] == index[:, None]  # each later step: the row's own key
        mask = torch.cat([causal] + [diagonal] * len(earlier), dim=1)  # [S, (j+1) S]
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self._finish(residual, attended[0].transpose(0, 1).reshape(seq, -1)), (k, v)

    def step(self, hidden: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor,
             caches: list[HeadKV]) -> torch.Tensor:
        """One new position for each of R requests at once: hidden, embeddings [R, H] at positions
        [R], row r appended to caches[r] and attending all it holds -> next features [R, H]."""
        rows = hidden.shape[0]
        x, residual = self._inputs(hidden, embeddings)
        q, k, v = self._qkv(x, positions[:, None], rows, 1)  # [R, H*, 1, D]
        keys, values, mask = appended_and_padded(caches, k, v)  # [R, Hkv, L, D], padded
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)  # [R, Hq, 1, D]
        return self._finish(residual, attended.reshape(rows, -1))

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[..., N] over the draft vocabulary, float32."""
        return self.lm_head(rms_norm(features.to(self.dtype), self.norm, self.shape.rms_norm_eps)).float()

    def new_cache(self) -> HeadKV:
        return HeadKV(self.shape.num_kv_heads, self.shape.head_dim, self.dtype, self.fc.weight.device)
