"""EAGLE: one decoder layer drafts from the target's features, autoregressively (`heads/eagle.py`).

The engine hands the target's last hidden states at every committed position it fed
(`ReadsHiddenStates`); they wait here until the next draft, which first runs them through the
head (one call over all of them: its catch-up, writing its cache), then drafts on its own
predictions, one position a call. Drafted positions leave the cache when the draft is made: once
verified, their true features come back from the target and take their place.

Trees: each drafted position also offers its next candidates as leaves beside the chain (greedy
and seeded rows), the draft model's shape (`autoregressive.chain_with_leaves`). Trained by
`draftwise train-head --kind eagle` (`heads/eagle_training.py`), stored by `heads/store.py`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from draftwise.errors import InvalidParameterError
from draftwise.speculative.autoregressive import chain_with_leaves
from draftwise.speculative.heads.eagle import EagleHead, EagleShape, HeadKV
from draftwise.speculative.heads.eagle_training import train_eagle
from draftwise.speculative.heads.eagle_format import read_eagle, save_eagle
from draftwise.speculative.heads.store import head_folder
from draftwise.speculative.heads.training import Example, TrainResult, TrainSettings, training_vocabulary
from draftwise.speculative.proposer import Draft, Footprint
from draftwise.speculative.registry import DrafterSpec, Target, option, register
from draftwise.speculative.sequence import SequenceState
from draftwise.speculative.vocab_trim import head_weight, kept_token_ids, lm_rows_layer

KIND = "eagle"
LONGEST_DRAFT = 8  # the deepest chain a head is asked for (its acceptance falls with depth)
DEFAULT_KEPT = 32768  # the vocabulary a head trained elsewhere scores (the most frequent tokens)


@dataclass(slots=True)
class _RequestState:
    cache: HeadKV
    pending: list[torch.Tensor] = field(default_factory=list)  # [n, H] target states not yet in the cache
    last: torch.Tensor | None = None  # [H] the head's prediction at the newest position


class EagleProposer:
    catch_up_window = None

    def __init__(self, head: EagleHead, norm: torch.nn.Module, lm_rows: torch.nn.Module,
                 embed: torch.nn.Module, last_layer: int, branches: int = 1) -> None:
        self.head = head
        self.norm = norm  # the target's final norm: the head reads what its LM head reads
        self.lm_rows = lm_rows  # the target's LM head rows of the kept ids, in its weight format
        self.embed = embed  # the target's embedding
        self.branches = branches
        self.hidden_layers = (last_layer,)
        self.longest_draft = LONGEST_DRAFT
        self._states: dict[str, _RequestState] = {}

    def on_hidden(self, seqs: list[SequenceState], hidden: dict[int, list[torch.Tensor]]) -> None:
        for seq, states in zip(seqs, hidden[self.hidden_layers[0]]):  # [n, H] per row
            state = self._states.get(seq.request_id)
            if state is None:
                state = self._states[seq.request_id] = _RequestState(self.head.new_cache())
            state.pending.append(states)

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
        for j in range(max(num_tokens)):
            logits = self.head.logits(predicted, self.lm_rows)  # [live, N]
            if any(trees[r] for r in live):
                top_probs, top_index = logits.softmax(dim=-1).topk(self.branches, dim=-1)  # [live, branches]
                top_tokens, top_probs = self.head.kept_ids[top_index].tolist(), top_probs.tolist()
            best = self.head.kept_ids[logits.argmax(dim=-1)].tolist()  # [live]
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
            device = predicted.device
            embeddings = self.embed(torch.tensor([chains[r][-1] for r in live], device=device)).float()  # [live, H]
            positions = torch.tensor([len(seqs[wanted[r]].token_ids) - 1 + j for r in live], device=device)
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
            # No states (a cost profile's request) or out of step: draft from a zero feature with no
            # context (what it costs is the same; verification keeps the output exact either way).
            state = _RequestState(self.head.new_cache())
            features = torch.zeros(1, self.head.shape.hidden_size, device=self.head.fc.weight.device)
            first = len(tokens) - 2
            if seq.request_id in self._states:
                self._states[seq.request_id] = state
        elif waiting == 0:
            return state.last, state.cache
        else:
            features = self.norm(torch.cat(state.pending).to(self.head.fc.weight.device, torch.float32))  # [n, H]
            first = state.cache.length
            state.pending.clear()
        ids = torch.tensor(tokens[first + 1:first + 1 + len(features)], device=features.device)
        positions = torch.arange(first, first + len(features), device=features.device)
        state.last = self.head(features, self.embed(ids).float(), positions.clamp(min=0), state.cache)[-1]
        return state.last, state.cache

    def on_verified(self, seqs: list[SequenceState], num_accepted: list[int]) -> None:
        pass  # (the cache was rolled back when the draft was made)

    def release(self, seq: SequenceState) -> None:
        self._states.pop(seq.request_id, None)

    def footprint(self) -> Footprint:
        tensors = [*self.head.parameters(), *self.lm_rows.parameters(), *self.lm_rows.buffers()]
        shape = self.head.shape
        return Footprint(sum(t.numel() * t.element_size() for t in tensors),
                         2 * shape.num_kv_heads * shape.head_dim * self.head.fc.weight.element_size())


@dataclass(slots=True)
class EagleOptions:
    head: str | None = option(None, "an EAGLE head folder (`draftwise train-head --kind eagle`); default: "
                                    "the one trained for this target", cost=True)
    eagle_branches: int = option(1, "candidates per drafted position: > 1 drafts a tree (the chain and leaves "
                                    "beside it)", cost=True)

    def __post_init__(self) -> None:
        if self.head is not None and not isinstance(self.head, str):
            raise InvalidParameterError(f"head must be a folder path, got {self.head!r}")
        if not isinstance(self.eagle_branches, int) or isinstance(self.eagle_branches, bool) \
                or not 1 <= self.eagle_branches <= 8:
            raise InvalidParameterError(f"eagle_branches must be an integer in 1..8, got {self.eagle_branches!r}")


def load_head(folder: Path, hidden_size: int, vocab_size: int, tokenizer) -> EagleHead:
    """A head from `folder`; one trained elsewhere scores the DEFAULT_KEPT most frequent tokens."""
    return read_eagle(folder, hidden_size, vocab_size, lambda: kept_token_ids(tokenizer, DEFAULT_KEPT), KIND)[0]


def build_eagle(target: Target, options: EagleOptions) -> EagleProposer:
    folder = head_folder(KIND, "EAGLE", target.name, options.head)
    model = target.runner.model
    head = load_head(folder, model.config.hidden_size, model.config.vocab_size, target.tokenizer)
    head = faster_precision(head.to(model.norm.weight.device))
    return EagleProposer(head, model.norm, lm_rows_layer(model, head.kept_ids), model.embed_tokens,
                         model.config.num_hidden_layers - 1, options.eagle_branches)


def faster_precision(head: EagleHead) -> EagleHead:
    """The head in float32 or bfloat16, whichever drafts faster here (timed at load: on CPUs with
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


def head_shape(config, width: int | None) -> EagleShape:
    """The head's layer: the target's attention shape, an MLP `width` wide. Default: 4/3 of the
    hidden size (a multiple of 64, at most the target's), so that a draft token reads ~0.1 of what
    a target step reads: the 1.5B's layer at its own 8960 would read ~200 MB a token in float32."""
    default = min(config.intermediate_size, -(-config.hidden_size * 4 // 3 // 64) * 64)
    return EagleShape(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                      width or default, config.rope_theta, config.rms_norm_eps, config.attention_bias)


def train_eagle_head(model, tokenizer, target_name: str, examples: list[Example], settings: TrainSettings,
                     folder: Path, notes: dict, progress: bool = True) -> TrainResult:
    """A head over the answers' tokens and the most frequent others, trained and saved to `folder`."""
    config = model.config
    kept = training_vocabulary(examples, tokenizer, settings.kept_tokens)
    torch.manual_seed(settings.seed)
    head = EagleHead(head_shape(config, settings.head_width), kept)
    lm_rows = head_weight(model)[head.kept_ids].float().detach().cpu()  # [N, H], frozen

    def embed(ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model.embed_tokens(ids.to(model.norm.weight.device)).float().cpu()

    result = train_eagle(head, lm_rows, lambda ids: embed(ids).clone(), examples, config.vocab_size, settings,
                         folder / "checkpoint.pt", progress)
    save_eagle(folder, head, config.vocab_size, max_position_embeddings=config.max_position_embeddings, draftwise={
        "kind": KIND, "target": target_name, "kept_tokens": len(kept),
        "training": {**notes, "train_positions": result.train_positions, "heldout_positions": result.heldout_positions,
                     "settings": asdict(settings), "epochs": [asdict(r) for r in result.reports]}})
    (folder / "checkpoint.pt").unlink(missing_ok=True)  # trained to the end: nothing left to resume
    return result


register(DrafterSpec(KIND, "one decoder layer on the target's features, drafting on its own (draftwise train-head)",
                     EagleOptions, build_eagle, benchmark_by_default=False, train=train_eagle_head))
