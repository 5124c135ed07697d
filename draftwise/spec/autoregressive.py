"""Drafting k tokens one at a time with a model behind a runner (shared by draft-model and layer-skip)."""

from __future__ import annotations

import torch

from draftwise.engine.sequence import Sequence
from draftwise.model.runner import ModelRunner
from draftwise.sampling.sampler import SamplingBatch, sample_from_probs, sampling_probs
from draftwise.spec.proposer import Draft


def draft_autoregressively(runner: ModelRunner, rows: list[int], seqs: list[Sequence], num_tokens: list[int],
                           num_layers: int | None = None) -> list[Draft]:
    """Feed each row what its cache lacks of the sequence, then draft num_tokens[b] tokens
    (rows asked for none are left alone and get an empty draft).

    Greedy requests take the argmax; sampled requests draw from the warped draft distribution
    with the request's own generator and keep those probabilities for verification.
    The last drafted token is not fed back (the target's verification pass does that).
    """
    token_ids: list[list[int]] = [[] for _ in seqs]
    probs: list[list[torch.Tensor]] = [[] for _ in seqs]
    pending = [seq.token_ids[runner.length(row):] for seq, row in zip(seqs, rows)]
    for step in range(max(num_tokens, default=0)):
        live = [b for b, k in enumerate(num_tokens) if step < k]
        result = runner.forward([rows[b] for b in live], [pending[b] for b in live], [1] * len(live),
                                num_layers=num_layers)
        params = [seqs[b].params for b in live]
        sampling = SamplingBatch.build(params, [seqs[b].generator for b in live], result.logits.shape[-1],
                                       result.logits.device)
        if sampling.all_greedy:
            next_ids = result.logits.argmax(dim=-1).tolist()
        else:
            draft_probs = sampling_probs(result.logits, sampling)  # [n, V]
            sampled = sample_from_probs(draft_probs, sampling.generators)
            next_ids = torch.where(sampling.greedy, result.logits.argmax(dim=-1), sampled).tolist()
            for i, b in enumerate(live):
                if not params[i].greedy:
                    probs[b].append(draft_probs[i])
        for i, b in enumerate(live):
            token_ids[b].append(next_ids[i])
            pending[b] = [next_ids[i]]
    return [Draft(ids, torch.stack(p) if p else None) for ids, p in zip(token_ids, probs)]
