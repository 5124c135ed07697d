"""Drafting with a separate, smaller model that shares the target's vocabulary."""

from __future__ import annotations

from draftwise.engine.sequence import Sequence
from draftwise.model.runner import ModelRunner
from draftwise.spec.autoregressive import draft_autoregressively
from draftwise.spec.proposer import Draft


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, confidence_threshold: float = 0.0) -> None:
        self.runner = runner
        self.confidence_threshold = confidence_threshold
        self._rows: dict[str, int] = {}  # request id -> draft cache row

    def _row(self, seq: Sequence) -> int:
        if seq.request_id not in self._rows:
            self._rows[seq.request_id] = self.runner.allocate()
        return self._rows[seq.request_id]

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        return draft_autoregressively(self.runner, [self._row(seq) for seq in seqs], seqs, num_tokens,
                                      confidence_threshold=self.confidence_threshold)

    def on_verified(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        # The cache holds the old tokens and the drafts fed back; the accepted ones stay, the
        # rest is rolled back (all committed tokens but the newest are then cached).
        for seq in seqs:
            row = self._rows.get(seq.request_id)
            if row is not None:
                self.runner.truncate(row, min(self.runner.length(row), len(seq.token_ids) - 1))

    def lag(self, seq: Sequence) -> int:
        row = self._rows.get(seq.request_id)
        return len(seq.token_ids) - (0 if row is None else self.runner.length(row))

    def release(self, seq: Sequence) -> None:
        row = self._rows.pop(seq.request_id, None)
        if row is not None:
            self.runner.free(row)
