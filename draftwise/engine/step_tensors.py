"""Padding a step's ragged rows into the tensors verification takes."""

from __future__ import annotations

import torch

from draftwise.speculative.proposer import Draft


def pad_rows(flat: torch.Tensor, cu: list[int], width: int) -> torch.Tensor:
    """Ragged rows flat[cu[b]:cu[b+1]] ([N, V]) as one padded tensor [B, width, V]."""
    counts = [cu[b + 1] - cu[b] for b in range(len(cu) - 1)]
    if all(count == width for count in counts):
        return flat.view(len(counts), width, -1)
    padded = flat.new_zeros(len(counts), width, flat.shape[-1])
    for b, count in enumerate(counts):
        padded[b, :count] = flat[cu[b]:cu[b + 1]]
    return padded


def stack_draft_probs(drafts: list[Draft], width: int) -> torch.Tensor | None:
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


def draft_token_tensor(drafts: list[Draft], width: int, device: torch.device) -> torch.Tensor:
    """[B, K] drafted token ids, padded with 0 past each row's draft."""
    return torch.tensor([d.token_ids + [0] * (width - len(d.token_ids)) for d in drafts], dtype=torch.long,
                        device=device).view(len(drafts), width)
