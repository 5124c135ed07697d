"""A token embedding table kept as int4 groups of 32 (a scale and a minimum each), rows dequantized
on lookup.

From a GGUF's Q4_K table the rows are exactly the float32 values the file defines (scale * q -
minimum, computed in float32 as the conversion computed its fp32 table: tests check it bit for bit),
at 0.625 bytes a weight instead of 4: for the 1.5B's 151936 x 1536 table, 175 MB instead of 933 MB.
A lookup reads one row per token, so its cost does not matter.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP = 32


class Int4Embedding(nn.Module):
    def __init__(self, quants: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> None:
        """quants uint8 [V, H] in 0..15; scales, minimums [V, H/32]; row = scale * q - minimum."""
        super().__init__()
        self.num_embeddings, self.embedding_dim = quants.shape
        pairs = quants.to(torch.uint8).view(self.num_embeddings, -1, 2)  # [V, H/2, 2]
        self.nibbles = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()  # [V, H/2]: even column low
        self.scales = scales.float().contiguous()  # [V, H/32]
        self.minimums = minimums.float().contiguous()

    @classmethod
    def from_packed(cls, state: dict[str, torch.Tensor]) -> "Int4Embedding":
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.nibbles, layer.scales, layer.minimums = state["nibbles"], state["scales"], state["minimums"]
        layer.num_embeddings, layer.embedding_dim = layer.nibbles.shape[0], layer.nibbles.shape[1] * 2
        return layer

    def packed_state(self) -> dict[str, torch.Tensor]:
        return {"nibbles": self.nibbles, "scales": self.scales, "minimums": self.minimums}

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        flat = token_ids.reshape(-1)  # [N]
        return self.rows(flat).view(*token_ids.shape, self.embedding_dim)  # [..., H] float32

    def dequantized(self) -> torch.Tensor:
        """The whole table [V, H] (for tests; a trimmed head takes its `rows`)."""
        return self.rows(torch.arange(self.num_embeddings))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [N] of the table as float32 [N, H] (the rest left packed)."""
        packed = self.nibbles[ids]  # [N, H/2]
        quants = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(len(ids), -1, GROUP).float()  # [N, H/32, 32]
        rows = self.scales[ids][..., None] * quants - self.minimums[ids][..., None]
        return rows.view(len(ids), self.embedding_dim)
