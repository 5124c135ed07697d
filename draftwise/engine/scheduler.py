"""Continuous batching: which requests run in the next step, within the KV memory budget.

Requests wait in arrival order and run until they finish; they join and leave between steps.
A step is either the prefill of one new request (a prompt is fed alone: batching it with decode
rows would pad every row to the prompt's length) or a decode step of every running request. While
requests wait, prefills and decode steps alternate, so that running requests keep streaming while
new ones are admitted.

Memory: a request is admitted only if the free KV blocks hold its context plus a step's growth
(`step_tokens(seq)`: the most tokens a decode step appends to its row, 1 + its drafter's largest
draft, a tree's nodes counted; never more than the request may still emit, which drafts never
exceed), beside the blocks every running request's own next step takes (one block of headroom each
was too little where a step appends more than a block: the request admitted was preempted at the
next step, readmitted, preempted...). Before a decode step every running request
must be able to grow so; if the blocks run short the request admitted last is preempted: its blocks
are freed and it goes back to the front of the queue with everything it generated, and on
readmission its prefill recomputes the cache from its tokens, so its output is unchanged. A request
is refused only if its prompt and max_tokens could not fit the whole cache: its row never holds more
(and a plain row's growth does not depend on the drafters other requests use).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from draftwise.cache.block_manager import BlockManager
from draftwise.engine.sequence import Sequence
from draftwise.errors import PromptTooLongError


@dataclass(slots=True)
class ScheduledStep:
    seqs: list[Sequence]  # the rows of this step, in batch order
    is_prefill: bool  # a newly admitted (or resumed) request's context, alone


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, step_tokens: Callable[[Sequence], int],
                 release: Callable[[Sequence], None]) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.step_tokens = step_tokens  # the most tokens a decode step appends to a request's row
        self.release = release  # frees a request's blocks (and its drafter's state)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._last_was_prefill = False

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        self.waiting.append(seq)

    def check(self, seq: Sequence) -> None:
        """Refuse a request that could not run even alone in the whole cache (so that a request
        running alone always finishes): its row never holds more than its prompt and what it may emit."""
        worst_case = len(seq.token_ids) + seq.num_tokens_left
        needed = self.blocks.blocks_for(worst_case)
        if needed > self.blocks.num_blocks:
            raise PromptTooLongError(
                f"a prompt of {len(seq.prompt_token_ids)} tokens with up to {seq.num_tokens_left} new tokens "
                f"needs {needed} KV blocks of {self.blocks.block_size} tokens, but the whole cache has "
                f"{self.blocks.num_blocks} (raise kv_cache_memory_bytes, lower max_tokens or shorten the prompt)")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep | None:
        """The next step, or None when nothing can run."""
        if self.waiting and (not self.running or not self._last_was_prefill) and self._can_admit(self.waiting[0]):
            self._last_was_prefill = True
            seq = self.waiting.popleft()
            self.running.append(seq)
            return ScheduledStep([seq], is_prefill=True)
        self._last_was_prefill = False
        self._make_room()
        if not self.running:
            return None
        return ScheduledStep(list(self.running), is_prefill=False)

    def requeue(self, seq: Sequence) -> None:
        """A running request that holds no row (its prefill was interrupted) back to the front of the
        queue, where it was before the step."""
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self._last_was_prefill = False

    def remove(self, seq: Sequence) -> None:
        """A finished or aborted request leaves (its blocks are freed by its owner)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)

    # --- memory -----------------------------------------------------------------------------
    def _can_admit(self, seq: Sequence) -> bool:
        if len(self.running) >= self.max_num_seqs:
            return False
        needed = self.blocks.blocks_for(self._after_step(seq))
        return needed + sum(map(self._growth_blocks, self.running)) <= self.blocks.num_free_blocks

    def _after_step(self, seq: Sequence) -> int:
        """The most tokens the request's row holds during its next decode step."""
        return len(seq.token_ids) + min(self.step_tokens(seq), seq.num_tokens_left)

    def _growth_blocks(self, seq: Sequence) -> int:
        if seq.row is None:  # (not prefilled yet: nothing of it held)
            return self.blocks.blocks_for(self._after_step(seq))
        held = len(self.blocks.tables[seq.row])
        return max(0, self.blocks.blocks_for(self._after_step(seq)) - held)

    def _make_room(self) -> None:
        """Preempt the latest admitted requests until every running one can take a step."""
        while self.running and sum(map(self._growth_blocks, self.running)) > self.blocks.num_free_blocks:
            self.preempt(self.running[-1])

    def preempt(self, seq: Sequence) -> Sequence:
        """Send a running request back to the front of the queue, freeing its blocks; it keeps its
        tokens and recomputes its cache when readmitted."""
        self.running.remove(seq)
        self.release(seq)
        self.waiting.appendleft(seq)
        seq.metrics.num_preemptions += 1
        return seq
