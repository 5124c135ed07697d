"""Log-probabilities of the tokens a step committed, from the verification pass itself (vLLM's raw
logprobs: the log-softmax of the target's logits before penalties, grammars and temperature). A
drafted token's logits come from the same pass that verified it, and the kernels give a position
the same bits whether it is verified alone or beside a draft, so they equal plain decoding's."""

from __future__ import annotations

from collections.abc import Callable

import torch

from draftwise.engine.outputs import Logprob


def token_logprobs(raw_logits: torch.Tensor, token_ids: list[int], top: int,
                   decode: Callable[[int], str] | None = None) -> list[dict[int, Logprob]]:
    """raw_logits [n, V] at the positions that produced token_ids [n] -> per token {id: Logprob} for
    it and the `top` most likely (-1: all V), each with its text from `decode` (token id -> text)."""
    if not token_ids:
        return []
    top = raw_logits.shape[-1] if top == -1 else min(top, raw_logits.shape[-1])
    logprobs = torch.log_softmax(raw_logits[:len(token_ids)].float(), dim=-1)  # [n, V]
    chosen = torch.tensor(token_ids, device=logprobs.device)
    chosen_logprobs = logprobs.gather(-1, chosen[:, None])  # [n, 1]
    ranks = (logprobs > chosen_logprobs).sum(-1) + 1  # [n]
    best_values, best_ids = logprobs.topk(top, dim=-1) if top else (None, None)
    result = []
    for i, token in enumerate(token_ids):
        entry = {token: Logprob(float(chosen_logprobs[i]), int(ranks[i]), decode and decode(token))}
        if top:
            for rank, (value, other) in enumerate(zip(best_values[i].tolist(), best_ids[i].tolist()), start=1):
                if other not in entry:
                    entry[other] = Logprob(value, rank, decode and decode(other))
        result.append(entry)
    return result
