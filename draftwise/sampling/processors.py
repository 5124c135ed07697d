"""Logits processors: what a request's allowed tokens, penalties, logit bias, min_tokens and bad
words do to the target's logits at a position, given the tokens before it. vLLM's semantics and
order: allowed_token_ids keeps only its tokens, min_tokens and bad words ban tokens, logit_bias adds,
then the penalties (repetition: prompt and output tokens, a positive logit divided by r and a
negative one multiplied; frequency and presence: output tokens, minus frequency x count and
presence x [count > 0]); temperature, min_p, top-k and top-p follow in `sampler.warp_logits`.
Greedy decoding takes the argmax of the processed logits.

Speculation verifies k drafted tokens in one pass: position i of a row must be processed as plain
decoding would process it, i.e. with the committed tokens *and the draft's first i tokens* as its
history. `process_positions` does exactly that for every position of a step at once: what the
committed history implies for all positions (dense per-row vectors), then, position by position,
each drafted token's own contribution to the positions after it. Nothing is stored between steps,
so a rejected draft needs no rollback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftwise.sampling.params import SamplingParams


@dataclass(slots=True)
class RowHistory:
    """What the processors of one row need to know: its parameters and the tokens before position 0."""
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]  # committed output tokens
    stop_ids: frozenset[int]  # end tokens min_tokens holds back (EOS and stop_token_ids)
    bad_words_ids: list[list[int]]  # each bad word as token ids (`bad_word_ids`)


def needs_processing(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
                or params.logit_bias or params.min_tokens or params.bad_words or params.allowed_token_ids)


def process_positions(logits: torch.Tensor, histories: list[RowHistory], drafts: list[list[int]]) -> torch.Tensor:
    """logits [R, W, V] of R rows, position i of row r predicting the token after its committed tokens
    and drafts[r][:i] -> the processed logits (a new tensor). W >= 1 + len(drafts[r])."""
    out = logits.float().clone()
    vocab = out.shape[-1]
    for r, (history, draft) in enumerate(zip(histories, drafts)):
        _process_row(out[r], history, draft, vocab)
    return out


def _process_row(row: torch.Tensor, history: RowHistory, draft: list[int], vocab: int) -> None:
    """row [W, V] in place."""
    params = history.params
    width = row.shape[0]
    positions = min(width, len(draft) + 1)
    # Bans first (-inf stays -inf under every later step).
    if params.allowed_token_ids:
        outside = torch.ones(vocab, dtype=torch.bool)
        outside[[t for t in params.allowed_token_ids if t < vocab]] = False
        row[:positions, outside] = float("-inf")
    if params.min_tokens:
        for i in range(positions):
            if len(history.output_ids) + i < params.min_tokens:
                row[i, [t for t in history.stop_ids if t < vocab]] = float("-inf")
    if history.bad_words_ids:
        for i in range(positions):
            banned = _banned_by_bad_words(history.output_ids + draft[:i], history.bad_words_ids)
            if banned:
                row[i, banned] = float("-inf")
    if params.logit_bias:
        bias = torch.zeros(vocab)
        for token, value in params.logit_bias.items():
            if token < vocab:
                bias[token] = value
        row += bias  # [W, V] + [V]
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[[t for t in history.prompt_ids + history.output_ids if t < vocab]] = True
        _repetition(row, seen, params.repetition_penalty)  # every position: the committed history
        for j, token in enumerate(draft[:positions - 1]):  # draft token j is history from position j + 1 on
            if not seen[token]:
                seen[token] = True
                later = row[j + 1:positions, token]
                row[j + 1:positions, token] = torch.where(later > 0, later / params.repetition_penalty,
                                                          later * params.repetition_penalty)
    if params.frequency_penalty or params.presence_penalty:
        counts = torch.bincount(torch.tensor(history.output_ids, dtype=torch.long), minlength=vocab)[:vocab]
        row -= (params.frequency_penalty * counts + params.presence_penalty * (counts > 0)).to(row.dtype)
        for j, token in enumerate(draft[:positions - 1]):
            row[j + 1:positions, token] -= params.frequency_penalty + (
                params.presence_penalty if counts[token] == 0 else 0.0)
            counts[token] += 1


def _repetition(row: torch.Tensor, seen: torch.Tensor, penalty: float) -> None:
    """HF/vLLM repetition penalty on the tokens `seen` [V], at every position of row [W, V], in place."""
    chosen = row[:, seen]
    row[:, seen] = torch.where(chosen > 0, chosen / penalty, chosen * penalty)


def _banned_by_bad_words(history: list[int], bad_words_ids: list[list[int]]) -> list[int]:
    """The tokens that would complete a bad word here: a one-token word always; a longer one's last
    token when the history ends with its other tokens."""
    banned = []
    for word in bad_words_ids:
        prefix = word[:-1]
        if not prefix or history[-len(prefix):] == prefix:
            banned.append(word[-1])
    return banned


def bad_word_ids(words: list[str], encode) -> list[list[int]]:
    """Each bad word as token ids, as written and with a leading space (vLLM's rule: a word may
    start mid-text after a space)."""
    found = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = encode(text)
            if ids and ids not in found:
                found.append(ids)
    return found
