"""Logits processors under speculation: each verified position of a row with penalties, a logit
bias, min_tokens or bad words is processed with the history plain decoding would have there, its
committed tokens and the draft's tokens before it (`sampling.processors`). Verification then
compares the draft with the processed target, token for token as plain decoding samples it."""

from __future__ import annotations

import torch

from draftwise.engine.sequence import Sequence
from draftwise.sampling.processors import RowHistory, needs_processing, process_positions
from draftwise.speculative.proposer import Draft


def processed_rows(batch: list[Sequence]) -> list[int]:
    return [b for b, seq in enumerate(batch) if needs_processing(seq.params)]


def chain_rows(batch: list[Sequence]) -> list[int]:
    """Rows that draft chains, not trees: a processed row (a position's history is the chain before
    it) and one that reports logprobs (a token's logits sit at its position in the chain)."""
    return [b for b, seq in enumerate(batch) if needs_processing(seq.params) or seq.logprobs is not None]


def apply_processors(batch: list[Sequence], drafts: list[Draft], skipped: list[bool],
                     target_logits: torch.Tensor) -> torch.Tensor:
    """target_logits [B, K+1, V] with every processed row's positions processed (a new tensor where
    any row is; the pass's own logits untouched). Such rows draft chains (`Engine._propose`)."""
    rows = processed_rows(batch)
    if not rows:
        return target_logits
    histories = [RowHistory(batch[b].params, batch[b].prompt_token_ids, batch[b].output_ids, batch[b].end_token_ids,
                            batch[b].bad_words_ids) for b in rows]
    row_drafts = [[] if skipped[b] else drafts[b].token_ids for b in rows]
    processed = target_logits.clone() if target_logits.dtype == torch.float32 else target_logits.float()
    index = torch.tensor(rows, device=target_logits.device)
    processed[index] = process_positions(target_logits[index], histories, row_drafts).to(processed.dtype)
    return processed
