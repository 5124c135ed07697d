"""Medusa heads (Cai et al. 2024): K residual blocks on the target's last hidden state.

The target's LM head turns the hidden state h_t (after its final norm) into the distribution of
token t + 1. Head i (i = 0..K-1) predicts token t + 2 + i from the same h_t:

    logits_i = W_lm . (h_t + SiLU(A_i h_t + b_i))        A_i: [H, H], W_lm: the target's LM head rows

so one verification pass gives, at its last kept position, everything a K-token draft needs: no
pass of its own, no cache. W_lm is the target's own head (frozen), cut to the N most frequent
tokens (`vocab_trim.kept_token_ids`): a token off the list is never drafted, which costs
acceptance only. A_i starts at zero, so an untrained head i proposes what the LM head predicts for
t + 1, the rough guess Medusa starts from.

Serving scores the kept rows in the target's weight format (an int4 target: int4 rows and the same
kernels, ~N x H / 2 bytes read per step for all K heads at once); training uses them in float.
"""

from __future__ import annotations

import torch
from torch import nn

from draftwise.speculative.vocab_trim import rows_dtype


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, kept_ids: torch.Tensor) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(num_heads))
        self.register_buffer("kept_ids", kept_ids.clone())  # [N] vocabulary ids the heads score

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, H] (after the target's final norm) -> [M, K, H], head i's input to the LM rows."""
        return torch.stack([block(hidden) for block in self.blocks], dim=1)

    def logits(self, hidden: torch.Tensor, lm_rows: nn.Module | torch.Tensor) -> torch.Tensor:
        """[M, K, N] over the kept ids; lm_rows: [N, H] float rows, or a layer computing x @ rows.T."""
        features = self.features(hidden)  # [M, K, H]
        if isinstance(lm_rows, torch.Tensor):
            return features @ lm_rows.t()
        return lm_rows(features.to(rows_dtype(lm_rows))).float()[..., :len(self.kept_ids)]
