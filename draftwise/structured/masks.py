"""The allowed tokens at every position a step verifies, for a batch of constrained rows.

llguidance writes one bitmask per position (int32 words, bit j of word w = token 32 w + j): for
row r with draft d_1..d_k, position 0 is the mask after its committed tokens and position i the
mask after d_1..d_i (computed by advancing through the draft and rolling back; positions after a
token outside the grammar stay all-allowed, since verification stops at that token anyway).

Through llguidance's numpy API, not its torch one: `llguidance.torch` imports torch's compiler
(dynamo, inductor, Triton) for a function this module does not use, ~190 MB resident and ~2 s at
import in every process that imports the engine, constrained requests or not.
"""

from __future__ import annotations

import llguidance
import llguidance.numpy
import torch

from draftwise.structured.matcher import RequestGrammar

_EXECUTOR: llguidance.LLExecutor | None = None


def executor() -> llguidance.LLExecutor:
    global _EXECUTOR  # one pool of llguidance threads for the process, made on first use
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor(num_threads=1)
    return _EXECUTOR


def fill_masks(rows: list[tuple[RequestGrammar, list[int]]], width: int, vocab_size: int) -> torch.Tensor:
    """bitmask [R * width, W] int32: row r's masks at positions 0..len(draft) from r * width on (the
    rest all-allowed). width: at least the longest draft + 1."""
    bitmask = llguidance.numpy.allocate_token_bitmask(len(rows) * width, vocab_size)  # all bits set
    with_drafts = [(grammar.matcher, r * width, draft) for r, (grammar, draft) in enumerate(rows) if draft]
    without = [(grammar.matcher, r * width) for r, (grammar, draft) in enumerate(rows) if not draft]
    if with_drafts:
        llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(executor(), with_drafts, bitmask)
    if without:
        llguidance.numpy.fill_next_token_bitmask_par(executor(), without, bitmask)
    return torch.from_numpy(bitmask)  # (shares the array's memory)


_BYTE_BIAS = torch.where((torch.arange(256)[:, None] >> torch.arange(8)) & 1 == 1, 0.0, float("-inf"))  # [256, 8]


def refusal_bias(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[N, W] int32 bitmask -> [N, V] float32 on `device`: 0 where the token is allowed, -inf where
    refused, to add to logits. Each byte of the mask looks up its 8 values in a table (one gather;
    unpacking the bits to a bool mask and filling by it took 6-9x as long on the CPU)."""
    as_bytes = bitmask.contiguous().view(torch.uint8).to(device=device, dtype=torch.long)  # [N, 4 W]
    bias = torch.nn.functional.embedding(as_bytes, _BYTE_BIAS.to(device))  # [N, 4 W, 8]
    return bias.view(bitmask.shape[0], -1)[:, :vocab_size]


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, W] int32 bitmask -> [N, V] bool, True where the token is allowed. (Little-endian words
    read as bytes: token 8 b + j is bit j of byte b.)"""
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [N, 4 W]
    bits = (as_bytes.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1  # [N, 4 W, 8]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
