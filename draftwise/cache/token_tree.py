"""Where the tokens of a token tree sit, and which keys each of them reads.

A pass may feed a row a tree instead of a chain: token s has a parent parents[s] among the pass's
tokens (-1: it follows the row's cached tokens; parents[s] < s). Tokens are stored one after
another from the row's length, as a chain would be, but each is *at* position length + depth(s)
(its RoPE position; siblings share one) and attends the cached keys and then exactly its
ancestors and itself: `path(s)`, the stored positions of those keys in depth order. Committing a
root path afterwards moves its keys and values to the positions a chain would have given them
(`KVCache.move`).
"""

from __future__ import annotations


def check_parents(parents: list[int]) -> None:
    """Raise ValueError unless every token's parent comes before it (-1: the cached tokens)."""
    for s, parent in enumerate(parents):
        if not -1 <= parent < s:
            raise ValueError(f"token {s} of a tree has parent {parent}: parents must come first (-1 for the root)")


def depths(parents: list[int]) -> list[int]:
    """[S] each token's depth: 0 for the tokens right after the cached ones."""
    out: list[int] = []
    for parent in parents:
        out.append(0 if parent < 0 else out[parent] + 1)
    return out


def paths(parents: list[int], start: int) -> list[list[int]]:
    """[S][depth + 1] the stored positions token s attends among the pass's tokens (stored from
    `start` on): its ancestors from the top, then itself."""
    out: list[list[int]] = []
    for s, parent in enumerate(parents):
        out.append((out[parent] if parent >= 0 else []) + [start + s])
    return out


def chain_parents(length: int) -> list[int]:
    """A chain as a tree: each token the child of the one before."""
    return list(range(-1, length - 1))
