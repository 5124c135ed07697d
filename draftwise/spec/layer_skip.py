"""Self-speculation: the target's first L layers, final norm and LM head draft for the full model.

The draft pass writes keys/values of layers < L into the target's own cache at the positions the
verification pass then overwrites with all layers, so drafting needs no cache of its own.
"""

from __future__ import annotations

from draftwise.engine.sequence import Sequence
from draftwise.model.runner import ModelRunner
from draftwise.spec.autoregressive import draft_autoregressively
from draftwise.spec.proposer import Draft


class LayerSkipProposer:
    def __init__(self, target_runner: ModelRunner, num_layers: int, confidence_threshold: float = 0.0) -> None:
        self.runner = target_runner
        self.num_layers = num_layers
        self.confidence_threshold = confidence_threshold

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        rows = [seq.row for seq in seqs]
        lengths = [self.runner.length(row) for row in rows]
        drafts = draft_autoregressively(self.runner, rows, seqs, num_tokens, num_layers=self.num_layers,
                                        confidence_threshold=self.confidence_threshold)
        for row, length in zip(rows, lengths):
            self.runner.truncate(row, length)  # the target's verification pass starts from here
        return drafts

    def on_verified(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def lag(self, seq: Sequence) -> int:
        return 0
