"""The one interface every drafter implements; the engine never asks which drafter it has."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from draftwise.cache import token_tree
from draftwise.speculative.sequence import SequenceState


@dataclass(slots=True)
class Draft:
    token_ids: list[int]  # [k] proposed continuation (may be shorter than asked, or empty)
    probs: torch.Tensor | None = None  # [k, V] the distribution each token was drawn from; None: deterministic
    # A token tree instead of a chain: parents[i] < i is the index of token i's parent, -1 for a
    # child of the newest committed token (`speculative/verify_tree.py`). None: a chain.
    parents: list[int] | None = None
    # A tree's nodes, each scored with its estimated probability of being accepted (never above its
    # parent's): the first kept_nodes always verified, the rest best first, of which the engine
    # verifies the prefix that pays (`control/tree_shape.py`).
    scores: list[float] | None = None
    kept_nodes: int = 0

    def prefix(self, num_nodes: int) -> "Draft":
        """The first num_nodes nodes (a tree still: parents come first)."""
        return Draft(self.token_ids[:num_nodes], None if self.probs is None else self.probs[:num_nodes],
                     None if self.parents is None else self.parents[:num_nodes],
                     None if self.scores is None else self.scores[:num_nodes], min(self.kept_nodes, num_nodes))

    def depth(self) -> int:
        """The longest root path's length (a chain: its length)."""
        if self.parents is None:
            return len(self.token_ids)
        return max(token_tree.depths(self.parents), default=-1) + 1

    def first_children(self) -> "Draft":
        """The chain a tree's first children make (root's first child, its first child, ...): a
        draft in its own right, each token drawn from its row of `probs` as a chain's are (a
        first sibling is drawn from the drafter's whole distribution). For what verifies chains only."""
        if self.parents is None:
            return self
        chain, parent = [], -1
        for i, p in enumerate(self.parents):
            if p == parent:
                chain.append(i)
                parent = i
        probs = None if self.probs is None else self.probs[chain]
        return Draft([self.token_ids[i] for i in chain], probs)


@dataclass(frozen=True, slots=True)
class Footprint:
    """Memory a drafter adds to the target's: its own weights, and KV cache per token it holds."""

    weights_bytes: int = 0
    kv_bytes_per_token: int = 0


class Proposer(Protocol):
    # The most backlog a first draft absorbs (a draft model's context window; None: unbounded, or
    # no cache at all). The planner's simulator charges catch-ups with it.
    catch_up_window: int | None
    # (Optional) the longest draft it can propose (a head with K heads: K); k is capped there.
    # (Optional) `tree_nodes(k)`: the most nodes a draft of depth k holds, where its drafts are trees
    # (k: a chain's); the scheduler reserves a row's KV blocks for them and the engine cuts a draft there.
    # (Optional) `forget_history()`: drop what earlier requests left it (a cache of their text), as
    # a fresh drafter would be; `LLM.forget_drafter_history` calls it (benchmarks measuring new traffic).
    # (Optional) `reset_prefix_cache()`: a drafter with a prefix cache of its own forgets it, as the
    # target's does; `LLM.reset_prefix_cache` calls it.

    def propose(self, seqs: list[SequenceState], num_tokens: list[int]) -> list[Draft]:
        """Up to num_tokens[b] tokens continuing seqs[b] (all of its committed tokens)."""

    def on_verified(self, seqs: list[SequenceState], num_accepted: list[int]) -> None:
        """Called after the target committed tokens: roll own state back to what was kept, learn."""

    def release(self, seq: SequenceState) -> None:
        """The sequence has finished (or its state must be rebuilt): free anything held for it."""

    def lag(self, seq: SequenceState) -> int:
        """Committed tokens the drafter has yet to absorb before it can draft for `seq` (its own
        cache's backlog: the whole prompt before the first draft; 0 for drafters without a cache)."""

    def footprint(self) -> Footprint:
        """The memory this drafter adds (the planner reports it)."""


class ReadsHiddenStates(Protocol):
    """What a drafter adds to `Proposer` to draft from the target's own features (a trained head):
    the engine captures those layers in every pass that has one of its rows, at no extra pass."""

    hidden_layers: tuple[int, ...]  # target layers (0-based) whose residual stream it reads

    def on_hidden(self, seqs: list[SequenceState], hidden: dict[int, list[torch.Tensor]]) -> None:
        """After each pass, per layer and row [n, H]: the residual stream at every token the pass fed
        that stays committed, in order (a prefill: the prompt; a verification: the token fed before
        the draft, then the kept draft tokens). Its last row produced the row's newest token; each
        row t's token is followed, in the sequence, by the token its logits chose."""


class CachelessProposer:
    """What a drafter without state of its own per request needs of the protocol: nothing to roll
    back, release or catch up on, and no memory beyond the target's (prompt lookup, layer skip)."""

    catch_up_window = None

    def on_verified(self, seqs: list[SequenceState], num_accepted: list[int]) -> None:
        pass

    def release(self, seq: SequenceState) -> None:
        pass

    def lag(self, seq: SequenceState) -> int:
        return 0

    def footprint(self) -> Footprint:
        return Footprint()
