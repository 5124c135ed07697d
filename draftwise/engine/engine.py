"""The decode loop: schedule, propose, verify in one target pass, commit or roll back, feed back.

Plain decoding is the case without a proposer: every step verifies an empty draft, which is
ordinary sampling from the target. Rows of a batch are ragged (each has its own length and
accepts its own number of tokens); nothing is realigned, every row rolls back by bookkeeping.

Failure isolation: a step that raises is undone for every row (each keeps the tokens it has
committed; its cache is cut back to them; its drafter forgets it) and then run again row by row. A
row that fails alone has its request end with an error (`finish_reason` "error"); every other row
takes its step as if nothing had happened, so one bad request (a value that slipped through, its
drafter, its KV growth) never changes another's output. A fault that every row meets alone (the
engine itself is broken) ends every request, each with the error.
"""

from __future__ import annotations

import logging
import time
from functools import partial

import torch

from draftwise.engine.constrained import (PendingMasks, after_commit, answer_tokens, DeadPositions, forced_drafts,
                                         nothing_allowed, with_forced, within_grammar)
from draftwise.engine.hidden_states import HiddenRecorder, hand_hidden, hidden_layers, kept_positions, reads_hidden
from draftwise.engine.logprobs import token_logprobs
from draftwise.engine.processed import apply_processors, chain_rows
from draftwise.engine.scheduler import Scheduler
from draftwise.engine.sequence import Sequence, rows_by_method
from draftwise.engine.step_tensors import draft_token_tensor, pad_rows, stack_draft_probs
from draftwise.engine.step_timing import DraftCall, StepCounters, StepTiming
from draftwise.engine.thread_governor import ThreadGovernor
from draftwise.errors import InvalidParameterError, KVCacheFullError
from draftwise.runner.model_runner import ModelRunner
from draftwise.sampling.sampler import SamplingBatch
from draftwise.speculative.control.live_costs import LiveCostModel
from draftwise.speculative.control.tree_shape import nodes_that_pay
from draftwise.speculative.drafter import Drafter
from draftwise.speculative.proposer import Draft
from draftwise.speculative.verify import verify
from draftwise.speculative.verify_tree import verify_tree

logger = logging.getLogger(__name__)


class Engine:
    """Each request names its drafter (`seq.method`, None: plain decoding); rows of different
    drafters, and plain rows, share one batch and one verification pass."""

    def __init__(self, runner: ModelRunner, default_method: str | None = None, max_num_seqs: int = 8,
                 threads: ThreadGovernor | None = None) -> None:
        self.runner = runner
        self.threads = threads  # the CPU thread count per step (None: left as it is)
        self.drafters: dict[str, Drafter] = {}
        self.default_method = default_method  # what requests that do not say use
        self.scheduler = Scheduler(runner.blocks, max_num_seqs, self._step_tokens, self._release_state)
        self.last_num_tokens: dict[str, float] = {}  # method -> mean k over its rows in the last step
        self.counters = StepCounters()
        self.timing_listeners: list = []  # callables taking each step's `StepTiming`
        self._draft_calls: dict[str, DraftCall] = {}
        self._target_pass: tuple[int, float] = (0, 0.0)  # tokens, seconds of the step's target pass
        self._grammar_seconds = 0.0  # the step's structured-outputs work on this thread (masks waited for)
        self.recorder: HiddenRecorder | None = None  # keeps every request's hidden states (self-distillation)

    def add_drafter(self, method: str, drafter: Drafter) -> None:
        self.drafters[method] = drafter

    def _step_tokens(self, seq: Sequence) -> int:
        """The most tokens a decode step appends to the request's row: the newest token and its
        drafter's largest draft (a tree's nodes; `_propose` cuts a draft there)."""
        return 1 + (self.drafters[seq.method].max_nodes if seq.method in self.drafters else 0)

    def add(self, seq: Sequence) -> None:
        if seq.method is not None and seq.method not in self.drafters:
            raise InvalidParameterError(f"no drafter {seq.method!r}; this engine has {sorted(self.drafters)}")
        self.scheduler.add(seq)

    def check(self, seq: Sequence) -> None:
        """Raise if the request could never fit in the KV cache (what `add` would refuse)."""
        self.scheduler.check(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """One step; returns the sequences that received tokens or ended in it (finished ones included)."""
        step = self.scheduler.schedule()
        if step is None:
            if self.scheduler.has_unfinished():  # `check` makes this unreachable: fail loudly, never hang
                raise KVCacheFullError("no waiting request fits in the KV cache and none is running")
            return []
        if self.threads is not None:
            self.threads.before_step(step.is_prefill)
        try:
            self._run(step.seqs, step.is_prefill)
        except Exception as error:
            self._isolate(step.seqs, step.is_prefill, error)
        except BaseException:  # (Ctrl-C inside the step: every row back to where it was between steps)
            for seq in step.seqs:
                self._undo(seq)
            for seq in step.seqs:
                if seq.finished:
                    self._retire(seq)
                elif seq.row is None:  # (its prefill never finished: it waits to be admitted again)
                    self.scheduler.requeue(seq)
            raise
        for seq in step.seqs:
            if seq.finished:
                self._retire(seq)
        if self.threads is not None and not self.scheduler.has_unfinished():
            self.threads.idle()
        return step.seqs

    def _run(self, batch: list[Sequence], is_prefill: bool) -> None:
        """The step proper: propose, verify in one target pass, commit, feed back."""
        self._draft_calls = {}
        self._grammar_seconds = 0.0
        prompt = False  # whether the pass computes prompt tokens only (`model/prompt_pass.py`)
        if is_prefill:
            seq = batch[0]
            seq.row = self.runner.allocate()
            # (a head reading the target's states, or a recorder, needs the whole prompt's)
            cached = 0
            if not reads_hidden(self.drafters, seq) and self.recorder is None:
                cached = self.runner.share_prefix(seq.row, self._shareable(seq), seq.prefix_salt)
            if seq.num_cached_tokens is None:  # (vLLM's: counted when it first runs, not on a resume)
                seq.num_cached_tokens = cached
            if seq.output_ids:  # resumed after preemption: its prompt apart from what it generated
                self._feed_prompt(seq)
            else:
                prompt = True
            drafts, skipped, forced = [Draft([])], [False], set()
        else:
            drafts, skipped, forced = self._propose(batch)
        num_accepted = self._verify_and_commit(batch, drafts, skipped, prompt)
        if any(seq.grammar is not None for seq in batch):
            self.counters.constrained_steps += 1
            self.counters.grammar_seconds += self._grammar_seconds
        self._learn_timing(StepTiming(is_prefill, *self._target_pass, self._draft_calls))
        for method, rows in rows_by_method(batch).items():
            drafter = self.drafters[method]
            drafter.proposer.on_verified([batch[b] for b in rows], [num_accepted[b] for b in rows])
            for b in rows:
                if not skipped[b] and b not in forced:  # (a tree as the chain it was worth: its depth)
                    depth = drafts[b].depth()
                    drafter.draft_length.observe(batch[b], depth, min(num_accepted[b], depth))

    def _isolate(self, batch: list[Sequence], is_prefill: bool, error: Exception) -> None:
        """A step raised: undo it for every row, then run each row alone; a row that fails alone fails."""
        logger.error("a step over %d row(s) failed; isolating", len(batch), exc_info=error)
        for seq in batch:
            self._undo(seq)
        if len(batch) == 1:
            self._fail(batch[0], error)
            return
        for seq in batch:
            if seq.finished:  # it ended (EOS, a stop string) while committing, before the failure
                continue
            try:
                self._run([seq], is_prefill)
            except Exception as solo_error:
                logger.error("request %s failed alone", seq.request_id, exc_info=solo_error)
                self._undo(seq)
                self._fail(seq, solo_error)

    def _undo(self, seq: Sequence) -> None:
        """Back to the state between steps: the cache holds every committed token but the newest
        (a request whose prefill never finished holds no row), and the drafter forgets the request."""
        if seq.row is not None:
            if not seq.output_ids:
                self.runner.free(seq.row)
                seq.row = None
            else:
                self.runner.truncate(seq.row, min(self.runner.length(seq.row), len(seq.token_ids) - 1))
        if seq.method is not None:
            proposer = self.drafters[seq.method].proposer
            proposer.release(seq)
            if seq.row is not None and getattr(proposer, "hidden_layers", ()):
                # A head reading the target's states from the start (EAGLE's own cache) gets them
                # again: the next pass feeds the whole sequence.
                self.runner.truncate(seq.row, 0)

    @staticmethod
    def _fail(seq: Sequence, error: Exception) -> None:
        reason = "kv_cache_full" if isinstance(error, KVCacheFullError) else "engine_error"
        seq.fail(f"{type(error).__name__}: {error}", reason)

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """End a request now, waiting or running: its blocks and drafter state are freed at once."""
        seq.finish(reason)
        self._retire(seq)

    # --- the steps --------------------------------------------------------------------------
    def _propose(self, batch: list[Sequence]) -> tuple[list[Draft], list[bool], set[int]]:
        """Drafts; per row whether randomized drafting's coin turned the step into a plain one; the
        rows whose draft is what their grammar forces (not their drafter's)."""
        drafts = [Draft([]) for _ in batch]
        skipped = [False] * len(batch)
        forced = self._on_grammar(forced_drafts, batch, self.drafters, self._draft_rate)  # row -> forced tokens
        self.last_num_tokens = dict.fromkeys(self.drafters, 0.0)  # (a drafter without rows in this step drafts none)
        for method, rows in rows_by_method(batch).items():
            drafter = self.drafters[method]
            seqs = [batch[b] for b in rows]
            lags = [drafter.proposer.lag(seq) for seq in seqs]
            choices = drafter.draft_length.num_tokens(seqs, lags, len(batch))
            # Never draft past what the request may still emit: the verification adds one token.
            num_tokens = [max(0, min(k, seq.num_tokens_left - 1, seq.max_draft_tokens or k))
                          for k, seq in zip(choices, seqs)]
            self.last_num_tokens[method] = sum(num_tokens) / len(num_tokens)
            if drafter.draft_probability < 1:
                for i, seq in enumerate(seqs):
                    if num_tokens[i] and self._draft_rate(seq) < 1 and not _coin(drafter.draft_probability):
                        num_tokens[i], skipped[rows[i]] = 1, True  # tails: a plain step, which needs q at position 1
            if not any(num_tokens):
                continue
            start = time.perf_counter()
            proposals = drafter.proposer.propose(seqs, num_tokens)
            elapsed = time.perf_counter() - start
            # (a row drafting nothing absorbed nothing: its backlog is no part of the call's time)
            self._draft_calls[method] = DraftCall(num_tokens, elapsed, [lag if k else 0 for lag, k in zip(lags, num_tokens)])
            beside = len(batch) - 1  # the step's other rows, counted as plain ones
            for b, draft in zip(rows, proposals):
                if draft.scores is not None and drafter.costs is not None:  # a tree: the part that pays
                    pass_seconds = partial(_pass_seconds, drafter.costs, beside)
                    draft = draft.prefix(nodes_that_pay(draft.scores, pass_seconds, elapsed / len(rows),
                                                        draft.kept_nodes, beside))
                # Randomized drafting's relaxed test is for chains: such rows verify the tree's first children.
                drafts[b] = draft.first_children() if self._draft_rate(batch[b]) < 1 else draft
                if batch[b].grammar is not None:  # a chain inside the grammar
                    drafts[b] = self._on_grammar(within_grammar, batch[b], drafts[b], len(draft.token_ids))
                batch[b].metrics.spec.draft_seconds += elapsed
        for b, tokens in list(forced.items()):  # what the grammar forces, unless the drafter says more
            drafts[b], took_forced = with_forced(drafts[b], tokens[:self.drafters[batch[b].method].max_tokens])
            if not took_forced:
                del forced[b]
        for b in chain_rows(batch):
            drafts[b] = drafts[b].first_children()
        for b, seq in enumerate(batch):  # (a tree's nodes within the blocks reserved and the context: its
            limit = max(0, min(self._step_tokens(seq) - 1, seq.num_tokens_left))  # row holds its tokens + nodes)
            if len(drafts[b].token_ids) > limit:
                drafts[b] = drafts[b].prefix(limit)
        skipped = [skip and bool(draft.token_ids) for skip, draft in zip(skipped, drafts)]
        for seq, draft, skip in zip(batch, drafts, skipped):
            if seq.method is not None and (skip or not draft.token_ids):
                seq.metrics.spec.record_plain()
        return drafts, skipped, set(forced)

    def _shareable(self, seq: Sequence) -> list[int]:
        """The tokens whose cached blocks a sequence may share and offer: with prompt kernels its
        prompt's only (a generated token is computed by the decoding kernels, and the same token in a
        later prompt by the prompt kernels), else all it has committed."""
        return seq.prompt_token_ids if self.runner.prompt_kernels else seq.token_ids

    def _feed_prompt(self, seq: Sequence) -> None:
        """A resumed request's prompt, what the cache lacks of it, in a prompt pass of its own (its
        generated tokens follow in the step's pass, computed as when they were decoded)."""
        held = self.runner.length(seq.row)
        fed = seq.prompt_token_ids[held:]
        if not fed:
            return
        capture = self._captured_layers([seq])
        result = self.runner.forward([seq.row], [fed], [1], capture_layers=capture, prompt=True)
        if capture:
            self._hand_states([seq], [held], result.hidden, [torch.arange(len(fed))])

    def _captured_layers(self, batch: list[Sequence]) -> tuple[int, ...]:
        capture = hidden_layers(self.drafters, batch)
        if self.recorder is not None:
            capture = tuple(sorted(set(capture) | set(self.recorder.layers)))
        return capture

    def _hand_states(self, batch: list[Sequence], starts: list[int], hidden: dict[int, torch.Tensor],
                     kept: list[torch.Tensor]) -> None:
        """The hidden states of each row's committed fed tokens to the drafters that read them and the recorder."""
        hand_hidden(self.drafters, batch, hidden, kept)
        if self.recorder is not None:
            self.recorder.record(batch, starts, hidden, kept)

    def _verify_and_commit(self, batch: list[Sequence], drafts: list[Draft], skipped: list[bool],
                           prompt: bool = False) -> list[int]:
        start = time.perf_counter()
        rows = [seq.row for seq in batch]
        lengths = [self.runner.length(row) for row in rows]
        # Each row feeds what its cache lacks (the prompt, or the newest token) plus its draft
        # (not a skipped one: that row's plain step only needs the target at the first position).
        pending = [seq.token_ids[length:] for seq, length in zip(batch, lengths)]
        new_tokens = [ids + ([] if skip else d.token_ids) for ids, d, skip in zip(pending, drafts, skipped)]
        num_draft = [len(d.token_ids) for d in drafts]
        trees = [b for b, d in enumerate(drafts) if d.parents is not None and d.token_ids and not skipped[b]]
        parents = [_fed_parents(len(pending[b]), drafts[b].parents) if b in trees else None
                   for b in range(len(batch))] if trees else None
        capture = self._captured_layers(batch)
        masks = self._on_grammar(PendingMasks, batch, drafts, self.runner.model.config.vocab_size)  # beside the pass
        try:
            result = self.runner.forward(rows, new_tokens, [1 if skip else n + 1 for n, skip in zip(num_draft, skipped)],
                                         parents=parents, capture_layers=capture, prompt=prompt)
        except BaseException:
            masks.settle()  # (the mask thread still reads the grammars that undoing the step rewinds)
            raise
        width = max(num_draft)
        raw_logits = pad_rows(result.logits, result.cu_num_logits, width + 1)  # [B, K+1, V]
        target_logits = self._on_grammar(masks.apply, raw_logits)  # (constrained rows masked)
        target_logits = apply_processors(batch, drafts, skipped, target_logits)  # (penalties, bias, ...)
        dead = self._on_grammar(DeadPositions, batch, target_logits)  # constrained row -> nothing allowed there
        sampling = SamplingBatch.build([seq.params for seq in batch], [len(seq.output_ids) for seq in batch],
                                       target_logits.shape[-1], target_logits.device)
        output_ids, num_accepted = self._verify_chains(batch, drafts, skipped, target_logits, sampling, trees)
        paths: dict[int, list[int]] = {}  # tree row -> its kept nodes
        if trees:
            verified = verify_tree([drafts[b].token_ids for b in trees], [drafts[b].parents for b in trees],
                                   target_logits[trees], [drafts[b].probs for b in trees], sampling.select(trees))
            for b, tokens, path in zip(trees, verified.output_token_ids, verified.accepted_nodes):
                output_ids[b], num_accepted[b], paths[b] = tokens, len(path), path
                # The kept path's keys and values go where a chain would have put them.
                first = lengths[b] + len(pending[b])
                self.runner.keep_path(batch[b].row, [first + i for i in path], first)
        elapsed = time.perf_counter() - start
        self._target_pass = (self.runner.pass_tokens(list(map(len, new_tokens))), elapsed)  # (what the pass computed)
        if capture:  # the hidden states at every fed token that stays committed
            kept = kept_positions(result.cu_num_tokens, list(map(len, pending)), num_accepted, paths)
            self._hand_states(batch, lengths, result.hidden, kept)
        for b, (seq, tokens, accepted, drafted, skip, draft) in enumerate(zip(batch, output_ids, num_accepted,
                                                                              num_draft, skipped, drafts)):
            emitted, unsatisfiable, nothing_at = tokens[:accepted + 1], None, dead.get(b)
            if seq.grammar is not None:
                emitted, unsatisfiable = self._on_grammar(answer_tokens, seq, emitted, nothing_at)
            elif nothing_at is not None and nothing_at < len(emitted):  # (allowed_token_ids, all banned)
                emitted, unsatisfiable = emitted[:nothing_at], nothing_allowed(seq, nothing_at)
            committed = seq.append(emitted)
            if seq.logprobs is not None:
                seq.logprobs += token_logprobs(raw_logits[b], seq.output_ids[len(seq.output_ids) - committed:],
                                               seq.params.logprobs, seq.decode_token)
            self._on_grammar(after_commit, seq)
            if unsatisfiable is not None:
                seq.fail(unsatisfiable, "constraint_unsatisfiable")
            # Roll back: the cache keeps every committed token but the newest (fed next step).
            self.runner.truncate(seq.row, min(self.runner.length(seq.row), len(seq.token_ids) - 1))
            self.runner.register_prefix(seq.row, self._shareable(seq), seq.prefix_salt)
            if not skip:  # (what verification accepted, drafts past an end token too: the drafts' quality)
                seq.metrics.spec.record(drafted, accepted, draft.depth())
            if drafted:
                seq.metrics.spec.verify_seconds += elapsed
        return num_accepted

    def _verify_chains(self, batch: list[Sequence], drafts: list[Draft], skipped: list[bool],
                       target_logits: torch.Tensor, sampling: SamplingBatch,
                       trees: list[int]) -> tuple[list[list[int]], list[int]]:
        """Every row verified as a chain (tree rows' results are replaced by the caller): emitted
        tokens per row (then -1s) and accepted counts."""
        device = target_logits.device
        chains = [Draft([]) if b in trees else d for b, d in enumerate(drafts)]
        num_draft = [len(d.token_ids) for d in chains]
        width = target_logits.shape[1] - 1
        draft_rates = [self._draft_rate(seq) for seq in batch]  # [B] randomized drafting's a per row
        randomized = min(draft_rates) < 1
        verified = verify(draft_token_tensor(chains, width, device), torch.tensor(num_draft, device=device),
                          target_logits, stack_draft_probs(chains, width), sampling,
                          draft_rate=torch.tensor(draft_rates, device=device) if randomized else None,
                          draft_skipped=torch.tensor(skipped, device=device) if randomized else None)
        return verified.output_token_ids.tolist(), verified.num_accepted.tolist()  # the step's one host sync

    def _on_grammar(self, function, *args):
        """Structured outputs' share of the step, timed: the step's overhead of its constrained rows."""
        started = time.perf_counter()
        try:
            return function(*args)
        finally:
            self._grammar_seconds += time.perf_counter() - started

    def _learn_timing(self, timing: StepTiming) -> None:
        """Count the step; note how well the adaptive drafters' live costs predicted it, then teach
        them what it took (the target's pass to all, each drafter's call to its own); hand it to
        the listeners."""
        live = {method: d.costs for method, d in self.drafters.items() if isinstance(d.costs, LiveCostModel)}
        if not timing.is_prefill:
            if self.threads is not None:
                self.threads.observe(timing.num_tokens, timing.target_seconds)
            self.counters.decode_steps += 1
            self.counters.drafting_steps += any(any(call.num_tokens) for call in timing.drafts.values())
            if live and all(method in live for method in timing.drafts):
                some = next(iter(live.values()))
                predicted = some.target_seconds(timing.num_tokens) + sum(
                    live[method].call_seconds(call.num_tokens, call.lags) for method, call in timing.drafts.items())
                observed = timing.target_seconds + sum(call.seconds for call in timing.drafts.values())
                if observed > 0:
                    self.counters.predicted_over_observed.append(predicted / observed)
        for method, costs in live.items():
            costs.observe_step(timing, method)
        for listener in self.timing_listeners:
            listener(timing)

    def _draft_rate(self, seq: Sequence) -> float:
        """Randomized drafting's a for this row: its drafter's for unseeded sampled rows, 1 otherwise
        (greedy and seeded rows are verified by equality, where it has nothing to adjust)."""
        if seq.method is None or seq.params.greedy or seq.params.seed is not None:
            return 1.0
        return self.drafters[seq.method].draft_probability

    def _release_state(self, seq: Sequence) -> None:
        """Free the request's KV blocks and its drafter's state (finished, aborted or preempted)."""
        if seq.row is not None:
            self.runner.free(seq.row)
            seq.row = None
        if seq.method is not None:
            self.drafters[seq.method].proposer.release(seq)

    def _retire(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self._release_state(seq)
        if seq.method is not None:
            self.drafters[seq.method].draft_length.release(seq)


def _fed_parents(num_pending: int, draft_parents: list[int]) -> list[int]:
    """The parents of a row's fed tokens: its pending tokens as a chain, then the draft's tree
    below the last of them."""
    return list(range(-1, num_pending - 1)) + [num_pending - 1 if p < 0 else num_pending + p for p in draft_parents]


def _coin(probability: float) -> bool:
    return bool(torch.rand(()) < probability)


def _pass_seconds(costs, beside: int, num_tokens: int) -> float:
    """A target pass in which one row feeds num_tokens tokens and `beside` rows one each."""
    return costs.pass_seconds([num_tokens] + [1] * beside)
