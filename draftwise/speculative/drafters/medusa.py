"""Medusa: K heads on the target's last hidden state draft K tokens at once (`heads/medusa.py`).

The hidden state comes from the target's own pass (the engine captures it: `ReadsHiddenStates`), so
a draft costs the heads alone: K residual blocks and one scoring of the kept vocabulary rows. A
request's state is the one vector that produced its newest token. The heads are trained by
`draftwise train-head --kind medusa` (`heads/medusa_training.py`) and stored by `heads/store.py`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftwise.errors import InvalidParameterError, ModelFormatError
from draftwise.speculative.autoregressive import chain_with_leaves
from draftwise.speculative.heads.medusa import MedusaHeads
from draftwise.speculative.heads.medusa_training import train_medusa
from draftwise.speculative.heads.store import head_folder, read_head, save_head
from draftwise.speculative.heads.training import Example, TrainResult, TrainSettings, training_vocabulary
from draftwise.speculative.proposer import CachelessProposer, Draft, Footprint
from draftwise.speculative.registry import DrafterSpec, Target, option, register
from draftwise.speculative.sequence import SequenceState
from draftwise.speculative.vocab_trim import head_rows, lm_rows_layer

KIND = "medusa"


class MedusaProposer(CachelessProposer):
    def __init__(self, heads: MedusaHeads, norm: torch.nn.Module, lm_rows: torch.nn.Module, last_layer: int,
                 branches: int = 1) -> None:
        self.heads = heads
        self.branches = branches  # candidates per head: > 1 makes a tree (the chain, then leaves beside it)
        self.norm = norm  # the target's final norm: the heads read what its LM head reads
        self.lm_rows = lm_rows  # the target's LM head rows of the kept ids, in its weight format
        self.hidden_layers = (last_layer,)
        self.longest_draft = heads.num_heads  # (the engine caps k here)
        self._hidden: dict[str, torch.Tensor] = {}  # request id -> [H] the newest token's producer

    def on_hidden(self, seqs: list[SequenceState], hidden: dict[int, list[torch.Tensor]]) -> None:
        for seq, states in zip(seqs, hidden[self.hidden_layers[0]]):  # [n, H] per row
            self._hidden[seq.request_id] = states[-1]  # the newest token's producer

    def tree_nodes(self, k: int) -> int:
        """A draft of k heads: the chain of their best, and branches - 1 leaves beside each."""
        return k * self.branches

    def propose(self, seqs: list[SequenceState], num_tokens: list[int]) -> list[Draft]:
        wanted = [b for b, k in enumerate(num_tokens) if k > 0]
        drafts = [Draft([]) for _ in seqs]
        if not wanted:
            return drafts
        # (A request without a state yet, as in the cost profile's, drafts from zeros: same cost.)
        zeros = torch.zeros(self.heads.blocks[0].linear.in_features)
        hidden = torch.stack([self._hidden.get(seqs[b].request_id, zeros) for b in wanted])  # [R, H]
        with torch.inference_mode():
            logits = self.heads.logits(self.norm(hidden.to(torch.float32)), self.lm_rows)  # [R, K, N]
            if self.branches == 1:  # chains: the best of each head, no probabilities needed
                top_probs, top_index = None, logits.argmax(dim=-1, keepdim=True)  # [R, K, 1]
            else:
                top_probs, top_index = logits.softmax(dim=-1).topk(self.branches, dim=-1)  # [R, K, b]
            top_tokens = self.heads.kept_ids[top_index]  # [R, K, b]
        for r, b in enumerate(wanted):
            k = num_tokens[b]
            chain = top_tokens[r, :k, 0].tolist()
            # Trees for rows that keep the target's own path (greedy, seeded); an unseeded sampled
            # row's siblings would need the heads' distributions drawn without replacement.
            if top_probs is None or (not seqs[b].params.greedy and seqs[b].params.seed is None):
                drafts[b] = Draft(chain)
            else:
                # the chain, then each head's next candidates beside its token, scored by the heads' probabilities
                probs = top_probs[r, :k].tolist()  # [k, branches]
                leaves = [[(token, q, None) for token, q in zip(tokens, p[1:])]
                          for tokens, p in zip(top_tokens[r, :k, 1:].tolist(), probs)]
                drafts[b] = chain_with_leaves(chain, [p[0] for p in probs], leaves, [])
        return drafts

    def release(self, seq: SequenceState) -> None:
        self._hidden.pop(seq.request_id, None)

    def footprint(self) -> Footprint:
        tensors = [*self.heads.parameters(), *self.lm_rows.parameters(), *self.lm_rows.buffers()]
        return Footprint(sum(t.numel() * t.element_size() for t in tensors))


@dataclass(slots=True)
class MedusaOptions:
    head: str | None = option(None, "a Medusa head folder (`draftwise train-head --kind medusa`); default: "
                                    "the one trained for this target", cost=True)
    medusa_branches: int = option(1, "candidates per head: > 1 drafts a tree (the chain and leaves beside it)",
                                  cost=True)

    def __post_init__(self) -> None:
        if self.head is not None and not isinstance(self.head, str):
            raise InvalidParameterError(f"head must be a folder path, got {self.head!r}")
        if not isinstance(self.medusa_branches, int) or isinstance(self.medusa_branches, bool) \
                or not 1 <= self.medusa_branches <= 8:
            raise InvalidParameterError(f"medusa_branches must be an integer in 1..8, got {self.medusa_branches!r}")


def load_heads(folder: Path, hidden_size: int, vocab_size: int) -> MedusaHeads:
    config, tensors = read_head(folder, KIND, hidden_size, vocab_size)
    try:
        kept = tensors["kept_ids"]
        heads = MedusaHeads(hidden_size, int(config["num_heads"]), kept)
        heads.load_state_dict(tensors)
    except (KeyError, RuntimeError, ValueError, TypeError) as error:
        raise ModelFormatError(f"{folder}: the weights do not match its config ({error})") from None
    if kept.numel() == 0 or int(kept.max()) >= vocab_size or int(kept.min()) < 0:
        raise ModelFormatError(f"{folder}: kept token ids outside the vocabulary")
    return heads.eval().requires_grad_(False)


def build_medusa(target: Target, options: MedusaOptions) -> MedusaProposer:
    folder = head_folder(KIND, "Medusa", target.name, options.head)
    model = target.runner.model
    heads = load_heads(folder, model.config.hidden_size, model.config.vocab_size).to(model.norm.weight.device)
    return MedusaProposer(heads, model.norm, lm_rows_layer(model, heads.kept_ids), model.config.num_hidden_layers - 1,
                          options.medusa_branches)


def train_medusa_head(model, tokenizer, target_name: str, examples: list[Example], settings: TrainSettings,
                      folder: Path, notes: dict, progress: bool = True) -> TrainResult:
    """Heads over the answers' tokens and the most frequent others, trained and saved to `folder`."""
    config = model.config
    kept = training_vocabulary(examples, tokenizer, settings)
    heads = MedusaHeads(config.hidden_size, settings.num_heads, kept)
    lm_rows = head_rows(model, heads.kept_ids).float().detach().cpu()  # [N, H], frozen
    result = train_medusa(heads, lm_rows, examples, config.vocab_size, settings, folder / "checkpoint.pt", progress)
    save_head(folder, heads.state_dict(), {
        "kind": KIND, "num_heads": heads.num_heads, "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size, "target": target_name, "kept_tokens": len(kept),
        "training": {**notes, "train_positions": result.train_positions, "heldout_positions": result.heldout_positions,
                     "settings": asdict(settings), "epochs": [asdict(r) for r in result.reports]}})
    (folder / "checkpoint.pt").unlink(missing_ok=True)  # trained to the end: nothing left to resume
    return result


register(DrafterSpec(KIND, "K heads on the target's last hidden state (trained by draftwise train-head)",
                     MedusaOptions, build_medusa, benchmark_by_default=False, train=train_medusa_head,
                     vllm_model_option="head"))
