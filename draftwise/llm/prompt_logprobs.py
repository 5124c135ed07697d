"""Log-probabilities of a prompt's own tokens (vLLM's `prompt_logprobs`): one teacher-forced pass
over the prompt without a cache, the LM head applied a chunk of positions at a time (a 2,000-token
prompt's logits would be 1.2 GB at once). The first token has none (nothing predicts it)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from draftwise.engine.logprobs import token_logprobs
from draftwise.engine.outputs import Logprob

CHUNK = 256  # positions whose logits exist at once


@torch.inference_mode()
def prompt_logprobs(model, token_ids: list[int], top: int,
                    decode: Callable[[int], str] | None = None) -> list[dict[int, Logprob] | None]:
    device = model.norm.weight.device
    tokens = torch.tensor([token_ids], device=device)  # [1, S]
    positions = torch.arange(len(token_ids), device=device)[None]  # [1, S]
    hidden, _ = model.hidden_states(tokens, positions, prompt=True)  # [1, S, H] (as the request's prefill computes it)
    result: list[dict[int, Logprob] | None] = [None]
    for start in range(0, len(token_ids) - 1, CHUNK):
        stop = min(start + CHUNK, len(token_ids) - 1)
        logits = model.logits(hidden[0, start:stop])  # [n, V]: position p predicts token p + 1
        result += token_logprobs(logits, token_ids[start + 1:stop + 1], top, decode)
    return result
