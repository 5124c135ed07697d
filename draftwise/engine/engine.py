"""The decode loop: admit waiting requests, run one batched step, commit tokens, retire finished ones."""

from __future__ import annotations

from collections import deque

from draftwise.engine.sequence import Sequence
from draftwise.model.runner import ModelRunner
from draftwise.sampling.sampler import SamplingBatch, sample


class Engine:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Sequence]:
        """One step; returns the sequences that received tokens (finished ones included)."""
        if self.waiting and self.runner.num_free_rows:
            batch = [self._admit(self.waiting.popleft())]  # prefill one prompt: no padding waste
        else:
            batch = list(self.running)
        if not batch:
            return []
        self._forward_and_commit(batch)
        for seq in batch:
            if seq.finished:
                self._retire(seq)
        return batch

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        seq.finish(reason)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self._retire(seq)

    def _admit(self, seq: Sequence) -> Sequence:
        seq.row = self.runner.allocate()
        self.running.append(seq)
        return seq

    def _retire(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.runner.free(seq.row)
        seq.row = None

    def _forward_and_commit(self, batch: list[Sequence]) -> None:
        rows = [seq.row for seq in batch]
        new_tokens = [seq.token_ids[self.runner.length(seq.row):] for seq in batch]  # prompt, or last token
        result = self.runner.forward(rows, new_tokens, num_logits=[1] * len(batch))
        sampling = SamplingBatch.build([seq.params for seq in batch], [seq.generator for seq in batch],
                                       result.logits.shape[-1], result.logits.device)
        next_ids = sample(result.logits, sampling).tolist()  # the step's one host sync
        for seq, token in zip(batch, next_ids):
            seq.append([token])
