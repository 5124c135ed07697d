"""EAGLE: one decoder layer drafts from the target's features, autoregressively (`heads/eagle.py`).

It reads the target's last layer after its final norm (what the target's LM head reads) and scores
its predictions with the target's own LM head rows. Drafting (catch-up, chains, trees) is
`heads/head_proposer.py`'s. Trained by `draftwise train-head --kind eagle`
(`heads/eagle_training.py`), stored by `heads/store.py`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftwise.errors import InvalidParameterError
from draftwise.speculative.heads.eagle import EagleHead, EagleShape
from draftwise.speculative.heads.eagle_training import train_eagle
from draftwise.speculative.heads.eagle_format import read_eagle, save_eagle
from draftwise.speculative.heads.head_proposer import HeadProposer, faster_precision
from draftwise.speculative.heads.store import head_folder
from draftwise.speculative.heads.training import Example, TrainResult, TrainSettings, training_vocabulary
from draftwise.speculative.registry import DrafterSpec, Target, option, register
from draftwise.speculative.vocab_trim import head_rows, kept_token_ids, lm_rows_layer

KIND = "eagle"
DEFAULT_KEPT = 32768  # the vocabulary a head trained elsewhere scores (the most frequent tokens)


@dataclass(slots=True)
class EagleOptions:
    head: str | None = option(None, "an EAGLE head folder (`draftwise train-head --kind eagle`); default: "
                                    "the one trained for this target", cost=True)
    eagle_branches: int = option(1, "> 1: EAGLE-2 trees: at each depth the best eagle_branches nodes each get "
                                  "that many children (at most 16 nodes; the engine verifies what pays)", cost=True)

    def __post_init__(self) -> None:
        if self.head is not None and not isinstance(self.head, str):
            raise InvalidParameterError(f"head must be a folder path, got {self.head!r}")
        if not isinstance(self.eagle_branches, int) or isinstance(self.eagle_branches, bool) \
                or not 1 <= self.eagle_branches <= 8:
            raise InvalidParameterError(f"eagle_branches must be an integer in 1..8, got {self.eagle_branches!r}")


def load_head(folder: Path, hidden_size: int, vocab_size: int, tokenizer) -> EagleHead:
    """A head from `folder`; one trained elsewhere scores the DEFAULT_KEPT most frequent tokens."""
    return read_eagle(folder, hidden_size, vocab_size, lambda: kept_token_ids(tokenizer, DEFAULT_KEPT), KIND)[0]


def build_eagle(target: Target, options: EagleOptions) -> HeadProposer:
    folder = head_folder(KIND, "EAGLE", target.name, options.head)
    model = target.runner.model
    head = load_head(folder, model.config.hidden_size, model.config.vocab_size, target.tokenizer)
    device = model.norm.weight.device
    head = faster_precision(head.to(device))
    lm_rows = lm_rows_layer(model, head.kept_ids)  # the target's LM head rows of the kept ids, in its weight format
    shape = head.shape
    return HeadProposer(head, (model.config.num_hidden_layers - 1,), shape.hidden_size,
                        to_features=model.norm,  # the head reads what the target's LM head reads
                        logits=lambda predicted: head.logits(predicted, lm_rows), embed=model.embed_tokens,
                        device=device, weights=[*head.parameters(), *lm_rows.parameters(), *lm_rows.buffers()],
                        kv_bytes_per_token=2 * shape.num_kv_heads * shape.head_dim * head.fc.weight.element_size(),
                        branches=options.eagle_branches)


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
    kept = training_vocabulary(examples, tokenizer, settings)
    torch.manual_seed(settings.seed)
    head = EagleHead(head_shape(config, settings.head_width), kept)
    lm_rows = head_rows(model, head.kept_ids).float().detach().cpu()  # [N, H], frozen

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
                     EagleOptions, build_eagle, benchmark_by_default=False, train=train_eagle_head,
                     train_reads=frozenset({"head_width", "bf16"}), vllm_model_option="head"))
