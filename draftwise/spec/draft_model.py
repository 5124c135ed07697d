"""Drafting with a separate, smaller model that shares the target's vocabulary.

Context window: the draft model reads at most the last `context_window` tokens of a request (its
cache then starts at that offset). Before its first draft it must absorb the prompt, which for a
long prompt costs more than drafting can save on a short answer (a 700-token RAG prompt takes the
0.5B ~3 s on a CPU). A draft conditioned on the recent text only may be accepted less often, never
wrongly: the target verifies every token. When the backlog grows past the window (the controller
took plain steps for a while), the cache restarts from the last `context_window` tokens.
"""

from __future__ import annotations

from draftwise.engine.sequence import Sequence
from draftwise.model.runner import ModelRunner
from draftwise.spec.autoregressive import draft_autoregressively
from draftwise.spec.proposer import Draft


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, confidence_threshold: float = 0.0,
                 context_window: int | None = None) -> None:
        self.runner = runner
        self.confidence_threshold = confidence_threshold
        self.context_window = context_window  # None: the whole context
        self._rows: dict[str, int] = {}  # request id -> draft cache row
        self._offsets: dict[str, int] = {}  # request id -> the first token the row holds

    def _row(self, seq: Sequence) -> int:
        if seq.request_id not in self._rows:
            self._rows[seq.request_id] = self.runner.allocate()
            self._offsets[seq.request_id] = 0
        row = self._rows[seq.request_id]
        if self.context_window is not None and self._backlog(seq) > self.context_window:
            self.runner.truncate(row, 0)  # restart from the window's start
            self._offsets[seq.request_id] = len(seq.token_ids) - self.context_window
        return row

    def _backlog(self, seq: Sequence) -> int:
        row = self._rows.get(seq.request_id)
        held = 0 if row is None else self._offsets[seq.request_id] + self.runner.length(row)
        return len(seq.token_ids) - held

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        rows = [self._row(seq) for seq in seqs]
        return draft_autoregressively(self.runner, rows, seqs, num_tokens,
                                      offsets=[self._offsets[seq.request_id] for seq in seqs],
                                      confidence_threshold=self.confidence_threshold)

    def on_verified(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        # The cache holds the old tokens and the drafts fed back; the accepted ones stay, the
        # rest is rolled back (all committed tokens but the newest are then cached).
        for seq in seqs:
            row = self._rows.get(seq.request_id)
            if row is not None:
                keep = len(seq.token_ids) - 1 - self._offsets[seq.request_id]
                self.runner.truncate(row, max(0, min(self.runner.length(row), keep)))

    def lag(self, seq: Sequence) -> int:
        backlog = self._backlog(seq)
        return backlog if self.context_window is None else min(backlog, self.context_window)

    def release(self, seq: Sequence) -> None:
        row = self._rows.pop(seq.request_id, None)
        self._offsets.pop(seq.request_id, None)
        if row is not None:
            self.runner.free(row)
