"""The decode loop: schedule, propose, verify in one target pass, commit or roll back, feed back.

Plain decoding is the case without a proposer: every step verifies an empty draft, which is
ordinary sampling from the target.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from draftwise.adaptive.policy import DraftLengthPolicy
from draftwise.engine.sequence import Sequence
from draftwise.model.runner import ModelRunner
from draftwise.sampling.sampler import SamplingBatch
from draftwise.spec.proposer import Draft, Proposer
from draftwise.spec.verify import verify


class Engine:
    def __init__(self, runner: ModelRunner, proposer: Proposer | None = None,
                 draft_length: DraftLengthPolicy | None = None, draft_probability: float = 1.0) -> None:
        self.runner = runner
        self.proposer = proposer if draft_length is not None else None
        self.draft_length = draft_length
        self.draft_probability = draft_probability  # randomized drafting (sampled requests; see spec.verify)
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
            drafts, skipped = [Draft([])], [False]
        else:
            batch = list(self.running)
            if not batch:
                return []
            drafts, skipped = self._propose(batch)
        num_accepted = self._verify_and_commit(batch, drafts, skipped)
        if self.proposer is not None:
            self.proposer.on_verified(batch, num_accepted)
            for seq, draft, accepted, skip in zip(batch, drafts, num_accepted, skipped):
                if not skip:
                    self.draft_length.observe(seq, len(draft.token_ids), accepted)
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

    # --- the steps --------------------------------------------------------------------------
    def _propose(self, batch: list[Sequence]) -> tuple[list[Draft], list[bool]]:
        """Drafts, and per row whether randomized drafting's coin turned the step into a plain one."""
        skipped = [False] * len(batch)
        if self.proposer is None:
            return [Draft([]) for _ in batch], skipped
        # Never draft past what the request may still emit: the verification adds one token.
        num_tokens = [max(0, min(self.draft_length.num_tokens(seq, self.proposer.lag(seq)), seq.num_tokens_left - 1))
                      for seq in batch]
        if self.draft_probability < 1:
            for b, seq in enumerate(batch):
                if num_tokens[b] and not seq.params.greedy and not _coin(self.draft_probability, seq.generator):
                    num_tokens[b], skipped[b] = 1, True  # tails: a plain step, which needs q at position 1
        if not any(num_tokens):
            drafts = [Draft([]) for _ in batch]
        else:
            start = time.perf_counter()
            drafts = self.proposer.propose(batch, num_tokens)
            elapsed = time.perf_counter() - start
            for seq in batch:
                seq.metrics.spec.draft_seconds += elapsed
        skipped = [skip and bool(draft.token_ids) for skip, draft in zip(skipped, drafts)]
        for seq, draft, skip in zip(batch, drafts, skipped):
            seq.metrics.spec.num_plain_steps += skip or not draft.token_ids
        return drafts, skipped

    def _verify_and_commit(self, batch: list[Sequence], drafts: list[Draft], skipped: list[bool]) -> list[int]:
        start = time.perf_counter()
        rows = [seq.row for seq in batch]
        # Each row feeds what its cache lacks (the prompt, or the newest token) plus its draft
        # (not a skipped one: that row's plain step only needs the target at the first position).
        new_tokens = [seq.token_ids[self.runner.length(seq.row):] + ([] if skip else d.token_ids)
                      for seq, d, skip in zip(batch, drafts, skipped)]
        num_draft = [len(d.token_ids) for d in drafts]
        result = self.runner.forward(rows, new_tokens, [1 if skip else n + 1 for n, skip in zip(num_draft, skipped)])
        width = max(num_draft)
        device = result.logits.device
        target_logits = _pad_rows(result.logits, result.cu_num_logits, width + 1)  # [B, K+1, V]
        sampling = SamplingBatch.build([seq.params for seq in batch], [seq.generator for seq in batch],
                                       target_logits.shape[-1], device)
        draft_ids = torch.tensor([d.token_ids + [0] * (width - len(d.token_ids)) for d in drafts],
                                 dtype=torch.long, device=device)
        randomized = self.draft_probability < 1 and not sampling.all_greedy
        verified = verify(draft_ids.view(len(batch), width), torch.tensor(num_draft, device=device),
                          target_logits, _stack_draft_probs(drafts, width), sampling,
                          draft_rate=_draft_rates(batch, self.draft_probability, device) if randomized else None,
                          draft_skipped=torch.tensor(skipped, device=device) if randomized else None)
        output_ids = verified.output_token_ids.tolist()  # the step's one host sync
        num_accepted = verified.num_accepted.tolist()
        elapsed = time.perf_counter() - start
        for seq, tokens, accepted, drafted, skip in zip(batch, output_ids, num_accepted, num_draft, skipped):
            seq.append(tokens[:accepted + 1])
            # Roll back: the cache keeps every committed token but the newest (fed next step).
            self.runner.truncate(seq.row, min(self.runner.length(seq.row), len(seq.token_ids) - 1))
            if not skip:
                seq.metrics.spec.record(drafted, accepted)
            if drafted:
                seq.metrics.spec.verify_seconds += elapsed
        return num_accepted

    def _admit(self, seq: Sequence) -> Sequence:
        seq.row = self.runner.allocate()
        self.running.append(seq)
        return seq

    def _retire(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.runner.free(seq.row)
        seq.row = None
        if self.proposer is not None:
            self.proposer.release(seq)
            self.draft_length.release(seq)


def _coin(probability: float, generator: torch.Generator | None) -> bool:
    return bool(torch.rand((), generator=generator, device=generator.device if generator else None) < probability)


def _draft_rates(batch: list[Sequence], probability: float, device) -> torch.Tensor:
    """[B] randomized drafting's a per row: the configured probability for sampled rows, 1 for greedy ones."""
    return torch.tensor([1.0 if seq.params.greedy else probability for seq in batch], device=device)


def _pad_rows(flat: torch.Tensor, cu: list[int], width: int) -> torch.Tensor:
    """Ragged rows flat[cu[b]:cu[b+1]] ([N, V]) as one padded tensor [B, width, V]."""
    counts = [cu[b + 1] - cu[b] for b in range(len(cu) - 1)]
    if all(count == width for count in counts):
        return flat.view(len(counts), width, -1)
    padded = flat.new_zeros(len(counts), width, flat.shape[-1])
    for b, count in enumerate(counts):
        padded[b, :count] = flat[cu[b]:cu[b + 1]]
    return padded


def _stack_draft_probs(drafts: list[Draft], width: int) -> torch.Tensor | None:
    """[B, K, V] draft distributions, or None if every draft is deterministic (point masses)."""
    with_probs = [d.probs for d in drafts if d.probs is not None]
    if not with_probs or width == 0:
        return None
    vocab = with_probs[0].shape[-1]
    stacked = with_probs[0].new_zeros(len(drafts), width, vocab)
    for b, draft in enumerate(drafts):
        if draft.probs is not None:
            stacked[b, :len(draft.token_ids)] = draft.probs
        else:
            for i, token in enumerate(draft.token_ids):  # a deterministic draft in a sampled batch
                stacked[b, i, token] = 1.0
    return stacked
