"""Prompt lookup (n-gram) drafting: find the last n tokens earlier in the text, propose what followed."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from draftwise.engine.sequence import Sequence
from draftwise.spec.proposer import Draft


def find_continuation(token_ids: list[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The k tokens after the most recent earlier occurrence of the longest matching suffix.

    Tries suffix lengths max_n down to min_n; an occurrence must be followed by at least one token.
    """
    tokens = np.asarray(token_ids)
    if k <= 0:
        return []
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        windows = sliding_window_view(tokens[:-1], n)  # windows[s] = tokens[s:s+n], with s + n < len
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            start = int(starts[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Draft]:
        return [Draft(find_continuation(seq.token_ids, self.min_n, self.max_n, k)) for seq, k in zip(seqs, num_tokens)]

    def on_verified(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def lag(self, seq: Sequence) -> int:
        return 0
