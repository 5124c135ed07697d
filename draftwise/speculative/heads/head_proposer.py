"""Drafting with a one-layer head on the target's features, autoregressively (EAGLE-1, EAGLE-3).

The engine hands the target's residual streams at every committed position it fed
(`ReadsHiddenStates`, the layers the head reads, side by side); they wait here until the next draft,
which first turns them into the head's input features (`to_features`: EAGLE-1 the target's final
norm, EAGLE-3 its fusion of three layers) and runs them through the head (one call over all of
them: its catch-up, writing its cache), then drafts on its own predictions, one position a call for
all rows at once. Drafted positions leave the cache when the draft is made: once verified, their
true features come back from the target and take their place.

Trees (greedy and seeded rows, `branches` > 1): EAGLE-2's confidence-driven expansion (Li et al.
2024b). Every node is scored with the product of the head's probabilities along its path, its
estimate of being accepted; at each depth the `branches` best-scored nodes of the newest level each
get their `branches` most probable children, from one head call over all of them (each attends the
request's cache plus its own ancestors). The tree goes out best first, at most TREE_NODES nodes
(a child never scores above its parent, so every prefix is a tree); the engine verifies the prefix
that pays on the measured cost curve (`control/tree_shape.py`). Unseeded sampled rows draft chains.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from draftwise.speculative.heads.eagle import HeadKV
from draftwise.speculative.proposer import Draft, Footprint
from draftwise.speculative.sequence import SequenceState

LONGEST_DRAFT = 8  # the deepest chain a head is asked for (its acceptance falls with depth)
TREE_NODES = 16  # the most nodes a tree offers (EAGLE-2's budget, cut to a CPU's; the engine verifies what pays)


class FeatureHead(Protocol):
    kept_ids: torch.Tensor  # [N] the target ids its logits score

    def __call__(self, features: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor,
                 cache: HeadKV) -> torch.Tensor: ...  # [S, H] -> its next features [S, H]

    def step(self, features: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor,
             caches: list[HeadKV]) -> torch.Tensor: ...  # one position for each of R rows

    def new_cache(self) -> HeadKV: ...


@dataclass(slots=True)
class _RequestState:
    cache: HeadKV
    pending: list[torch.Tensor] = field(default_factory=list)  # [n, X] target states not yet in the cache
    last: torch.Tensor | None = None  # [H] the head's prediction at the newest position


class HeadProposer:
    catch_up_window = None

    def __init__(self, head: FeatureHead, hidden_layers: tuple[int, ...], state_width: int,
                 to_features: Callable[[torch.Tensor], torch.Tensor], logits: Callable[[torch.Tensor], torch.Tensor],
                 embed: torch.nn.Module, device: torch.device, weights: list[torch.Tensor],
                 kv_bytes_per_token: int, branches: int = 1) -> None:
        """to_features: target states [n, X] (the layers side by side) -> the head's input [n, H];
        logits: the head's features [R, H] -> float [R, N] over head.kept_ids; weights: what it
        adds to memory (its footprint)."""
        self.head = head
        self.hidden_layers = hidden_layers
        self.state_width = state_width  # X: the hidden size times the layers read
        self.to_features = to_features
        self.logits = logits
        self.embed = embed  # the target's embedding
        self.device = device
        self.weights = weights
        self.kv_bytes_per_token = kv_bytes_per_token
        self.branches = branches
        self.longest_draft = LONGEST_DRAFT
        self._states: dict[str, _RequestState] = {}

    def on_hidden(self, seqs: list[SequenceState], hidden: dict[int, list[torch.Tensor]]) -> None:
        per_layer = [hidden[layer] for layer in self.hidden_layers]  # each: [n, H] per row
        for b, seq in enumerate(seqs):
            state = self._states.get(seq.request_id)
            if state is None:
                state = self._states[seq.request_id] = _RequestState(self.head.new_cache())
            rows = [states[b] for states in per_layer]
            state.pending.append(rows[0] if len(rows) == 1 else torch.cat(rows, dim=-1))  # [n, X]

    def lag(self, seq: SequenceState) -> int:
        state = self._states.get(seq.request_id)
        return 0 if state is None else sum(len(p) for p in state.pending)

    @torch.inference_mode()
    def tree_nodes(self, k: int) -> int:
        """A chain of k, or (branches > 1) a tree of at most TREE_NODES nodes."""
        return max(k, TREE_NODES) if self.branches > 1 else k

    def propose(self, seqs: list[SequenceState], num_tokens: list[int]) -> list[Draft]:
        """Each row's catch-up on its own (lengths differ); then the chains' drafting steps, all rows at
        once, and each tree row's expansion."""
        drafts = [Draft([]) for _ in seqs]
        wanted = [b for b, k in enumerate(num_tokens) if k > 0]
        if not wanted:
            return drafts
        caught_up = {b: self._catch_up(seqs[b]) for b in wanted}
        trees = [b for b in wanted if self.branches > 1
                 and not (not seqs[b].params.greedy and seqs[b].params.seed is None)]
        for b in trees:
            drafts[b] = self._tree(seqs[b], *caught_up[b], num_tokens[b])
        chains = [b for b in wanted if b not in trees]
        if chains:
            drafted = self._chains([seqs[b] for b in chains], [caught_up[b] for b in chains],
                                   [num_tokens[b] for b in chains])
            for b, tokens in zip(chains, drafted):
                drafts[b] = Draft(tokens)
        return drafts

    def _chains(self, seqs: list[SequenceState], caught_up: list[tuple[torch.Tensor, HeadKV]],
                num_tokens: list[int]) -> list[list[int]]:
        """The head's greedy chain for each row, its drafting steps over all rows at once."""
        predicted = torch.stack([p for p, _ in caught_up])  # [R, H]
        caches = [cache for _, cache in caught_up]
        committed = [cache.length for cache in caches]
        chains: list[list[int]] = [[] for _ in seqs]
        live = list(range(len(seqs)))  # rows still drafting
        for j in range(max(num_tokens)):
            best = self.head.kept_ids[self.logits(predicted).argmax(dim=-1)].tolist()  # [live]
            for i, r in enumerate(live):
                chains[r].append(best[i])
            going = [i for i, r in enumerate(live) if j + 1 < num_tokens[r]]
            if not going:
                break
            live = [live[i] for i in going]
            embeddings = self.embed(torch.tensor([chains[r][-1] for r in live], device=self.device)).float()  # [live, H]
            positions = torch.tensor([len(seqs[r].token_ids) - 1 + j for r in live], device=self.device)
            predicted = self.head.step(predicted[going], embeddings, positions, [caches[r] for r in live])
        for cache, length in zip(caches, committed):
            cache.truncate(length)  # drafted positions: their true features come with the verification
        return chains

    def _tree(self, seq: SequenceState, predicted: torch.Tensor, cache: HeadKV, depth: int) -> Draft:
        """EAGLE-2's expansion to `depth` from the head's feature [H] at the newest position, best first."""
        width, kept_ids = self.branches, self.head.kept_ids
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        levels: list[int] = []
        features: dict[int, torch.Tensor] = {-1: predicted}  # node -> the head's output at it [H] (-1: the root)
        caches: dict[int, HeadKV] = {-1: cache}  # node -> the request's cache plus the node's path

        def add_children(nodes: list[int], outputs: torch.Tensor) -> list[int]:
            top_probs, top_index = self.logits(outputs).softmax(dim=-1).topk(width, dim=-1)  # [n, width]
            added = []
            for node, probs, index in zip(nodes, top_probs.tolist(), kept_ids[top_index].tolist()):
                for q, token in zip(probs, index):
                    added.append(len(tokens))
                    tokens.append(token)
                    parents.append(node)
                    scores.append((scores[node] if node >= 0 else 1.0) * q)
                    levels.append(levels[node] + 1 if node >= 0 else 0)
            return added

        frontier = add_children([-1], predicted[None])
        newest = len(seq.token_ids) - 1  # a depth-d node's entry sits at position newest + d
        for level in range(1, depth):
            expand = sorted(frontier, key=lambda n: -scores[n])[:width]
            node_caches = [caches[parents[n]].prefix(caches[parents[n]].length) for n in expand]
            embeddings = self.embed(torch.tensor([tokens[n] for n in expand], device=self.device)).float()
            outputs = self.head.step(torch.stack([features[parents[n]] for n in expand]), embeddings,
                                     torch.full((len(expand),), newest + level - 1, device=self.device), node_caches)
            for i, n in enumerate(expand):
                features[n], caches[n] = outputs[i], node_caches[i]
            frontier = add_children(expand, outputs)  # (EAGLE-2 expands the newest level only)
        order = sorted(range(len(tokens)), key=lambda n: (-scores[n], levels[n]))[:TREE_NODES]
        place = {node: i for i, node in enumerate(order)}
        return Draft([tokens[n] for n in order], parents=[place[parents[n]] if parents[n] >= 0 else -1 for n in order],
                     scores=[scores[n] for n in order])

    def _catch_up(self, seq: SequenceState) -> tuple[torch.Tensor, HeadKV]:
        """The head's prediction [H] of the feature at the newest token's position, and the request's
        cache, holding every position before it. The waiting target states go through the head
        first, each beside the token its logits chose (the next one in the sequence)."""
        tokens = seq.token_ids
        state = self._states.get(seq.request_id)
        waiting = sum(len(p) for p in state.pending) if state else 0
        if state is None or state.cache.length + waiting != len(tokens) - 1 or (waiting == 0 and state.last is None):
            # No states (a cost profile's request) or out of step: draft from a zero state with no
            # context (what it costs is the same; verification keeps the output exact either way).
            state = _RequestState(self.head.new_cache())
            states = torch.zeros(1, self.state_width, device=self.device)
            first = len(tokens) - 2
            if seq.request_id in self._states:
                self._states[seq.request_id] = state
        elif waiting == 0:
            return state.last, state.cache
        else:
            states = torch.cat(state.pending).to(self.device, torch.float32)  # [n, X]
            first = state.cache.length
            state.pending.clear()
        features = self.to_features(states)  # [n, H]
        ids = torch.tensor(tokens[first + 1:first + 1 + len(features)], device=self.device)
        positions = torch.arange(first, first + len(features), device=self.device)
        state.last = self.head(features, self.embed(ids).float(), positions.clamp(min=0), state.cache)[-1]
        return state.last, state.cache

    def on_verified(self, seqs: list[SequenceState], num_accepted: list[int]) -> None:
        pass  # (the cache was rolled back when the draft was made)

    def release(self, seq: SequenceState) -> None:
        self._states.pop(seq.request_id, None)

    def footprint(self) -> Footprint:
        return Footprint(sum(t.numel() * t.element_size() for t in self.weights), self.kv_bytes_per_token)


def faster_precision(head: torch.nn.Module) -> torch.nn.Module:
    """A head (EAGLE-1 or 3) in float32 or bfloat16, whichever drafts faster here (timed at load: on CPUs with
    bf16 dot products, bfloat16 halves a draft step and makes a short catch-up ~5x cheaper, the
    float32 kernels being slow at a few rows). Drafts only propose: their precision moves
    acceptance, never the output. On CUDA: float32."""
    if head.fc.weight.device.type != "cpu":
        return head
    hidden = head.shape.hidden_size
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        head = head.to(dtype)
        cache = head.new_cache()
        with torch.inference_mode():
            head(torch.zeros(16, hidden), torch.zeros(16, hidden), torch.arange(16), cache)
            rows = torch.zeros(3, hidden)
            best = float("inf")
            for _ in range(3):  # a 3-token catch-up and one draft step, the best of three
                start = time.perf_counter()
                head(rows, rows, torch.arange(16, 19), cache)
                head(rows[:1], rows[:1], torch.tensor([19]), cache)
                best = min(best, time.perf_counter() - start)
                cache.truncate(16)
        times[dtype] = best
    return head.to(min(times, key=times.get))
