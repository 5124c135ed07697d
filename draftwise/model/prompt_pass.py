"""Prompt passes: the rows of a request's prompt, computed by kernels of their own where a layer has one.

A prompt is many rows at once, and on a CPU with AMX tiles a quantized layer multiplies many rows
fastest by dequantizing its weights to bf16 once and keeping the sums in the tiles
(`quant/kernels/amx_prompt.cpp`), where decoding and verification, a few rows at a time, are
fastest with int8 activations and VNNI. The two round differently, so which one computes a token
must never depend on what shares its pass, or greedy speculation would stop matching plain
decoding. The rule is the token's role: a prompt token is computed by the prompt kernel, a
generated one by the decoding kernel, whatever pass it is in, however long the prompt, however
many rows. Hence the engine feeds a prompt in passes of its own (a preempted request's generated
tokens after it, in another pass) and shares cached blocks of prompt tokens only
(`engine.engine`): a prompt's keys and values are then the same whether computed now or found in
the cache, and a generated token's the same whether it was decoded or recomputed after preemption.

Inside `prompt_pass()`, the layers that have a prompt kernel use it (`in_prompt_pass`); the decoder
layers run as Python modules (`Transformer.hidden_states`), whose other operations compute the same
bits as the native layers (`native_decoder.py`). DRAFTWISE_PROMPT_KERNELS=0 turns the prompt
kernels off (prompts then computed like every other token, to compare the two).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

PROMPT_KERNELS_ENV = "DRAFTWISE_PROMPT_KERNELS"

_inside = ContextVar("draftwise_prompt_pass", default=False)


def prompt_kernels_wanted() -> bool:
    """Whether layers may use prompt kernels at all (DRAFTWISE_PROMPT_KERNELS=0: never)."""
    return os.environ.get(PROMPT_KERNELS_ENV, "1") != "0"


@contextmanager
def prompt_pass() -> Iterator[None]:
    """The forward inside computes prompt tokens only."""
    token = _inside.set(True)
    try:
        yield
    finally:
        _inside.reset(token)


def in_prompt_pass() -> bool:
    """Whether the forward running now computes prompt tokens (never inside a compiled step: those
    compute decoding passes, and torch.compile cannot trace a ContextVar)."""
    return not torch.compiler.is_compiling() and _inside.get()
