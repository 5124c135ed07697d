"""Drafting with a one-layer head on the target's features, autoregressively (EAGLE-1, EAGLE-3).

The engine hands the target's residual streams at every committed position it fed
(`ReadsHiddenStates`, the layers the head reads, side by side); they wait here until the next draft,
which first turns them into the head's input features (`to_features`: EAGLE-1 the target's final
norm, EAGLE-3 its fusion of three layers) and runs them through the head (one call over all of
them: its catch-up, writing its cache), then drafts on its own predictions, one position a call for
all rows at once. Drafted positions leave the cache when the draft is made: once verified, their
true features come back from the target and take their place.

Trees: each drafted position also offers its next candidates as leaves beside the chain (greedy
and seeded rows), the draft model's shape (`autoregressive.chain_with_leaves`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from draftwise.speculative.autoregressive import chain_with_leaves
from draftwise.speculative.heads.eagle import HeadKV
from draftwise.speculative.proposer import Draft, Footprint
from draftwise.speculative.sequence import SequenceState

LONGEST_DRAFT = 8  # the deepest chain a head is asked for (its acceptance falls with depth)


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
    def propose(self, seqs: list[SequenceState], num_tokens: list[int]) -> list[Draft]:
        """Each row's catch-up on its own (lengths differ), then the drafting steps of all rows at once."""
        drafts = [Draft([]) for _ in seqs]
        wanted = [b for b, k in enumerate(num_tokens) if k > 0]
        if not wanted:
            return drafts
        caught_up = [self._catch_up(seqs[b]) for b in wanted]
        predicted = torch.stack([p for p, _ in caught_up])  # [R, H]
        caches = [cache for _, cache in caught_up]
        committed = [cache.length for cache in caches]
        trees = [self.branches > 1 and not (seqs[b].params.temperature > 0 and seqs[b].params.seed is None)
                 for b in wanted]
        chains: list[list[int]] = [[] for _ in wanted]
        confidences: list[list[float]] = [[] for _ in wanted]
        leaves: list[list] = [[] for _ in wanted]
        live = list(range(len(wanted)))  # rows still drafting
        kept_ids = self.head.kept_ids
        for j in range(max(num_tokens)):
            logits = self.logits(predicted)  # [live, N]
            if any(trees[r] for r in live):
                top_probs, top_index = logits.softmax(dim=-1).topk(self.branches, dim=-1)  # [live, branches]
                top_tokens, top_probs = kept_ids[top_index].tolist(), top_probs.tolist()
            best = kept_ids[logits.argmax(dim=-1)].tolist()  # [live]
            for i, r in enumerate(live):
                if trees[r]:  # (the chain's token is the first candidate, whatever a tie does)
                    chains[r].append(top_tokens[i][0])
                    confidences[r].append(top_probs[i][0])
                    leaves[r].append([(token, q, None) for token, q in zip(top_tokens[i][1:], top_probs[i][1:])])
                else:
                    chains[r].append(best[i])
            going = [i for i, r in enumerate(live) if j + 1 < num_tokens[wanted[r]]]
            if not going:
                break
            live = [live[i] for i in going]
            embeddings = self.embed(torch.tensor([chains[r][-1] for r in live], device=self.device)).float()  # [live, H]
            positions = torch.tensor([len(seqs[wanted[r]].token_ids) - 1 + j for r in live], device=self.device)
            predicted = self.head.step(predicted[going], embeddings, positions, [caches[r] for r in live])
        for r, b in enumerate(wanted):
            caches[r].truncate(committed[r])  # drafted positions: their true features come with the verification
            drafts[b] = chain_with_leaves(chains[r], confidences[r], leaves[r], []) if trees[r] else Draft(chains[r])
        return drafts

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
