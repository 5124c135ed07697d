"""What training a head works with, whatever its kind: examples (a text the target wrote and its
hidden states over it), settings, and per-epoch reports."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class Example:
    token_ids: torch.Tensor  # [S] prompt + answer
    answer_start: int  # index of the answer's first token
    hidden: torch.Tensor  # [S, H] float32, after the final norm: position t predicts token t + 1


@dataclass(slots=True)
class TrainSettings:
    num_heads: int = 4  # Medusa: heads; EAGLE: the draft depth its held-out acceptance is reported to
    epochs: int = 4
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    batch_size: int = 128  # positions per optimizer step
    heldout_share: float = 0.1  # examples kept out for acceptance per position (0: reported on the training set)
    seed: int = 0
    kept_tokens: int = 32768  # the vocabulary the head scores: the answers' tokens, then the most frequent
    head_width: int | None = None  # EAGLE: its layer's MLP width (None: 4/3 of the hidden size, at most the target's)


@dataclass(slots=True)
class EpochReport:
    epoch: int
    train_loss: float
    heldout_acceptance: list[float]  # [K]: share of held-out positions where heads 0..i are all right

    @property
    def mean_accepted(self) -> float:
        """Expected drafted tokens accepted per step with a chain of K: the sum over positions."""
        return sum(self.heldout_acceptance)


@dataclass(slots=True)
class TrainResult:
    settings: dict
    reports: list[EpochReport] = field(default_factory=list)
    train_positions: int = 0
    heldout_positions: int = 0
