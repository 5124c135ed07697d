"""Speculation under a grammar (structured outputs), for the rows of a step whose request has one.

- Drafts stay inside the grammar: a tree becomes its chain of first children, and a chain is cut
  at its first token the grammar does not allow, so the target never spends a pass on what
  follows it (`within_grammar`: where exactly, and why, depends on how the row is verified).
- Tokens the grammar forces (keys, punctuation, the rest of an enum value) are the draft of a
  speculating row where its drafter's (cut) draft is shorter: a point mass that the target still
  verifies, so a forced run costs one pass.
- Every position a row verifies is masked: the target's logits there keep only the tokens the
  grammar allows after the row's committed tokens and its draft so far. Verification then compares
  the draft with the masked target, exactly as plain constrained decoding samples from it (greedy:
  the masked argmax; sampled: the masked, renormalised distribution), so the output is the
  constrained target's, token for token. The masks are computed on a worker thread while the
  target's pass runs.
- After the commit the grammar advances over the committed tokens only (nothing to roll back).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from draftwise.engine.sequence import Sequence
from draftwise.speculative.proposer import Draft
from draftwise.structured.masks import fill_masks, refusal_bias

_MASK_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")


def forced_drafts(batch: list[Sequence], drafters: dict, draft_rate) -> dict[int, list[int]]:
    """Row -> the tokens its grammar forces next, for speculating rows with a grammar whose drafter
    drafts forced tokens (none forced: left out). At most what the request may still emit (less
    the token verification adds) and the row's own cap on k. Not for rows under randomized
    drafting (draft_rate below 1): its proof needs the proposal q that heads draft from to be the
    one tails' residual max(0, p - a q) subtracts, and whether forced tokens replace a draft
    depends on the draft's length, which differs between heads (k tokens) and tails (one)."""
    forced = {}
    for b, seq in enumerate(batch):
        if (seq.grammar is not None and seq.method is not None and drafters[seq.method].forced_drafts
                and draft_rate(seq) == 1):
            seq.grammar.sync(seq.output_ids)
            tokens = seq.grammar.forced_tokens()[:max(0, min(seq.num_tokens_left - 1, seq.max_draft_tokens or 64))]
            if tokens:
                forced[b] = tokens
    return forced


def with_forced(draft: Draft, forced: list[int]) -> tuple[Draft, bool]:
    """The row's draft, or the forced tokens where they are longer (a drafter that drafted as far
    says the same text in the model's own tokens, or more); and whether the forced tokens won."""
    if len(draft.token_ids) >= len(forced):
        return draft, False
    return Draft(list(forced)), True


def within_grammar(seq: Sequence, draft: Draft, limit: int) -> Draft:
    """The row's draft as a chain of at most `limit` tokens, cut where it leaves the grammar.

    Greedy and seeded rows keep the tokens the grammar allows: they are verified by equality with
    the target's own (masked) token, which a refused token can never equal. A row verified by
    rejection sampling keeps the first refused token too. Its masked target probability is 0, so
    verification rejects it for certain and draws the recovered token from the residual
    norm(max(0, p - q)) at that position, as it would have with the whole draft; cutting before it
    would draw from p instead, and tokens the drafter proposes outside the grammar would then be
    emitted with the drafter's probability of refused tokens moved onto p: not the target's
    distribution (tests/test_structured_sampling.py sees it at once)."""
    chain = draft.first_children()
    seq.grammar.sync(seq.output_ids)
    valid = seq.grammar.valid_prefix(chain.token_ids[:limit])
    by_rejection = not seq.params.greedy and seq.params.seed is None
    return chain.prefix(min(limit, valid + 1 if by_rejection else valid))


class PendingMasks:
    """The masks of one step's constrained rows, computing beside the target's pass."""

    def __init__(self, batch: list[Sequence], drafts: list[Draft], vocab_size: int) -> None:
        self.rows = [b for b, seq in enumerate(batch) if seq.grammar is not None]
        self.vocab_size = vocab_size
        self.width = 1 + max((len(drafts[b].token_ids) for b in self.rows), default=0)
        self._future: Future | None = None
        if self.rows:
            for b in self.rows:
                batch[b].grammar.sync(batch[b].output_ids)
            work = [(batch[b].grammar, drafts[b].token_ids) for b in self.rows]
            self._future = _MASK_THREAD.submit(fill_masks, work, self.width, vocab_size)

    def settle(self) -> None:
        """Wait for the masks' work to end, whatever its outcome (a failed step's grammars are then
        the engine's alone again)."""
        if self._future is not None:
            wait([self._future])

    def apply(self, target_logits: torch.Tensor) -> torch.Tensor:
        """target_logits [B, K+1, V] with every constrained row's disallowed tokens at -inf (a new
        tensor; the pass's own logits are left as they are: logprobs are the raw model's)."""
        if self._future is None:
            return target_logits
        bias = refusal_bias(self._future.result(), target_logits.shape[-1], target_logits.device)  # [R * width, V]
        width = min(self.width, target_logits.shape[1])
        masked = target_logits.clone()
        for r, b in enumerate(self.rows):
            masked[b, :width] += bias[r * self.width:r * self.width + width]  # (-inf where refused, else + 0)
        return masked


class DeadPositions:
    """Constrained row (a grammar, or allowed_token_ids) -> the first position of its pass where every
    token is excluded, its grammar's mask and the request's own exclusions together (allowed_token_ids,
    bad_words, min_tokens' ban on ending, logit_bias of -inf): nothing may be emitted there. Computed
    on the logits' device when built, read back on the first `get` (after verification's own host
    sync, so the step waits on the device once)."""

    def __init__(self, batch: list[Sequence], logits: torch.Tensor) -> None:
        """logits [B, K+1, V], masked and processed."""
        self.rows = [b for b, seq in enumerate(batch) if seq.grammar is not None or seq.params.allowed_token_ids]
        self._first: torch.Tensor | None = None
        self._first_of_row: dict[int, int] | None = None
        if self.rows:  # (each row's maximum: one read of its logits, no copy and no [K+1, V] temporary)
            none_left = torch.stack([logits[b].amax(-1) for b in self.rows]) == float("-inf")  # [R, K+1]
            self._first = torch.where(none_left.any(-1), none_left.int().argmax(-1), -1)  # [R], -1: none

    def get(self, row: int) -> int | None:
        if self._first_of_row is None:
            firsts = self._first.tolist() if self._first is not None else []
            self._first_of_row = dict(zip(self.rows, firsts))
        position = self._first_of_row.get(row, -1)
        return position if position >= 0 else None


def answer_tokens(seq: Sequence, tokens: list[int], dead: int | None) -> tuple[list[int], str | None]:
    """What a constrained row commits of the tokens its verification emitted, and why the request
    must then end in an error (None: it need not).
    - Nothing after its first end token: the grammar's sentence is over (plain constrained decoding
      stops there even under ignore_eos; a draft may run past it).
    - Nothing from a position where no token was allowed (`dead`): the constraint and the request's
      own exclusions leave nothing (the emitted token there is an argmax over nothing).
    - Nothing from a token the grammar refuses: an end token where the grammar cannot end, the only
      token llguidance allows where its sentence cannot go on."""
    seq.grammar.sync(seq.output_ids)
    tokens = seq.grammar.up_to_end(tokens)
    kind = seq.grammar.kind
    if dead is not None and dead < len(tokens):
        return tokens[:dead], (f"no token is allowed at output position {len(seq.output_ids) + dead}: the {kind} "
                               "constraint and the request's allowed_token_ids, bad_words, min_tokens or logit_bias "
                               "exclude every one")
    valid = seq.grammar.accepted_prefix(tokens)
    if valid < len(tokens):
        return tokens[:valid], (f"the {kind} constraint cannot be completed after output position "
                                f"{len(seq.output_ids) + valid}: nothing it allows can follow there")
    return tokens, None


def nothing_allowed(seq: Sequence, dead: int) -> str:
    """Why a row without a grammar ends at `dead`: its allowed_token_ids and bans leave nothing there."""
    return (f"no token is allowed at output position {len(seq.output_ids) + dead}: the request's "
            "allowed_token_ids, bad_words and min_tokens exclude every one")


def after_commit(seq: Sequence) -> None:
    """Advance the grammar over what the row committed; a grammar that is complete (its end token
    consumed, say under ignore_eos) ends the request."""
    if seq.grammar is None:
        return
    seq.grammar.sync(seq.output_ids)
    if seq.grammar.finished and not seq.finished:
        seq.finish("stop")
