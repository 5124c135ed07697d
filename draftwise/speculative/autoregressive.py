"""Drafting k tokens one at a time with a model behind a runner (shared by draft-model and layer-skip)."""

from __future__ import annotations

import torch

from draftwise.errors import InvalidParameterError
from draftwise.runner.model_runner import ModelRunner
from draftwise.sampling.sampler import SamplingBatch, sample_from_probs, sampling_probs
from draftwise.speculative.proposer import Draft
from draftwise.speculative.sequence import SequenceState


def draft_autoregressively(runner: ModelRunner, rows: list[int], seqs: list[SequenceState], num_tokens: list[int],
                           num_layers: int | None = None, confidence_threshold: float = 0.0,
                           offsets: list[int] | None = None) -> list[Draft]:
    """Feed each row what its cache lacks of the sequence, then draft num_tokens[b] tokens
    (rows asked for none are left alone and get an empty draft). Row b's cache holds the
    sequence's tokens from offsets[b] on (default 0: from the start).

    Confidence stop: a row stops drafting after a token the drafter gave a probability below
    `confidence_threshold` (that token is still proposed: it is already paid for, and costs only
    one more position in the verification pass).

    Greedy requests take the argmax; sampled requests draw from the warped draft distribution.
    A seeded request draws with the noise the target will use at that position (the coupling
    `draftwise/speculative/verify.py` describes: it is verified by equality, so no probabilities are
    kept); an unseeded one keeps its draft probabilities for rejection sampling.
    The last drafted token is not fed back (the target's verification pass does that).
    """
    token_ids: list[list[int]] = [[] for _ in seqs]
    probs: list[list[torch.Tensor]] = [[] for _ in seqs]
    offsets = offsets or [0] * len(seqs)
    pending = [seq.token_ids[offset + runner.length(row):] for seq, row, offset in zip(seqs, rows, offsets)]
    num_tokens = list(num_tokens)
    for step in range(max(num_tokens, default=0)):
        live = [b for b, k in enumerate(num_tokens) if step < k]
        if not live:  # every row stopped early (confidence)
            break
        result = runner.forward([rows[b] for b in live], [pending[b] for b in live], [1] * len(live),
                                num_layers=num_layers)
        params = [seqs[b].params for b in live]
        positions = [len(seqs[b].output_ids) + step for b in live]  # the output position each draft fills
        sampling = SamplingBatch.build(params, positions, result.logits.shape[-1], result.logits.device)
        if sampling.all_greedy:
            next_ids = result.logits.argmax(dim=-1)  # [n]
            confidence = torch.softmax(result.logits, dim=-1).amax(dim=-1) if confidence_threshold else None
        else:
            draft_probs = sampling_probs(result.logits, sampling)  # [n, V]
            sampled = sample_from_probs(draft_probs, sampling)
            next_ids = torch.where(sampling.greedy, result.logits.argmax(dim=-1), sampled)
            for i, b in enumerate(live):
                if not params[i].greedy and params[i].seed is None:
                    probs[b].append(draft_probs[i])
            confidence = None
            if confidence_threshold:  # the probability of the token drafted (greedy rows: the top one)
                greedy_confidence = torch.softmax(result.logits, dim=-1).amax(dim=-1)
                drafted_probs = draft_probs.gather(-1, next_ids[:, None]).squeeze(-1)
                confidence = torch.where(sampling.greedy, greedy_confidence, drafted_probs)
        unsure = (confidence < confidence_threshold).tolist() if confidence is not None else [False] * len(live)
        for i, b in enumerate(live):
            token = int(next_ids[i])
            token_ids[b].append(token)
            pending[b] = [token]
            if unsure[i]:
                num_tokens[b] = step + 1  # confidence stop
    return [Draft(ids, torch.stack(p) if p else None) for ids, p in zip(token_ids, probs)]


def check_confidence(threshold: float) -> None:
    """The confidence stop's threshold (an option of every autoregressive drafter)."""
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0.0 <= threshold < 1.0:
        raise InvalidParameterError(f"draft_confidence_threshold must be in [0, 1), got {threshold!r}")
