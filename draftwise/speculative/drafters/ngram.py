"""Prompt lookup (n-gram) drafting: find the last n tokens earlier in the text, propose what followed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from draftwise.errors import InvalidParameterError
from draftwise.speculative.proposer import CachelessProposer, Draft
from draftwise.speculative.registry import DrafterSpec, Target, option, register
from draftwise.speculative.sequence import SequenceState


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


class NgramProposer(CachelessProposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[SequenceState], num_tokens: list[int]) -> list[Draft]:
        return [Draft(find_continuation(seq.token_ids, self.min_n, self.max_n, k)) for seq, k in zip(seqs, num_tokens)]



@dataclass(slots=True)
class NgramOptions:
    prompt_lookup_min: int = option(1, "shortest suffix to look up", cost=True)
    prompt_lookup_max: int = option(4, "longest suffix to look up", cost=True)

    def __post_init__(self) -> None:
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (self.prompt_lookup_min,
                                                                            self.prompt_lookup_max)) \
                or not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidParameterError(
                f"need integers 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min!r}, "
                f"{self.prompt_lookup_max!r}")


def build_ngram(target: Target, options: NgramOptions) -> NgramProposer:
    return NgramProposer(options.prompt_lookup_min, options.prompt_lookup_max)


register(DrafterSpec("ngram", "prompt lookup: the tokens that followed the latest earlier match of the last n tokens",
                     NgramOptions, build_ngram))
