"""EAGLE-3: one decoder layer drafts from a fusion of the target's low, middle and high features
(`heads/eagle3.py`), with its own LM head over a draft vocabulary.

The engine hands it the target's residual streams entering the three layers its config names
(speculators' `eagle_aux_hidden_state_layer_ids`; the stream after layer i - 1 in the engine's
numbering), side by side; drafting (catch-up, chains, trees) is `heads/head_proposer.py`'s. Heads
are read and written in speculators' EAGLE-3 format (`heads/eagle3_format.py`), so one trained
elsewhere for the same target serves here and ours serve in vLLM. Trained by
`draftwise train-head --kind eagle3` (`heads/eagle3_training.py`: training-time test).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftwise.errors import InvalidParameterError
from draftwise.speculative.heads.eagle3 import Eagle3Head, Eagle3Shape
from draftwise.speculative.heads.eagle3_format import default_aux_layers, read_eagle3, save_eagle3
from draftwise.speculative.heads.eagle3_training import train_eagle3
from draftwise.speculative.heads.head_proposer import HeadProposer, faster_precision
from draftwise.speculative.heads.store import head_folder
from draftwise.speculative.heads.training import Example, TrainResult, TrainSettings, training_vocabulary
from draftwise.speculative.registry import DrafterSpec, Target, option, register
from draftwise.speculative.vocab_trim import head_rows

KIND = "eagle3"


@dataclass(slots=True)
class Eagle3Options:
    head: str | None = option(None, "an EAGLE-3 head folder (speculators' format; `draftwise train-head --kind "
                                    "eagle3`); default: the one trained for this target", cost=True)
    eagle3_branches: int = option(1, "> 1: EAGLE-2 trees: at each depth the best eagle3_branches nodes each get "
                                  "that many children (at most 16 nodes; the engine verifies what pays)", cost=True)

    def __post_init__(self) -> None:
        if self.head is not None and not isinstance(self.head, str):
            raise InvalidParameterError(f"head must be a folder path, got {self.head!r}")
        if not isinstance(self.eagle3_branches, int) or isinstance(self.eagle3_branches, bool) \
                or not 1 <= self.eagle3_branches <= 8:
            raise InvalidParameterError(f"eagle3_branches must be an integer in 1..8, got {self.eagle3_branches!r}")


def engine_layers(aux_layers: tuple[int, ...]) -> tuple[int, ...]:
    """speculators' ids name the layers whose input is read: the stream after layer i - 1 (0-based)."""
    return tuple(i - 1 for i in aux_layers)


def build_eagle3(target: Target, options: Eagle3Options) -> HeadProposer:
    folder = head_folder(KIND, "EAGLE-3", target.name, options.head)
    model = target.runner.model
    config = model.config
    head, aux_layers, _ = read_eagle3(folder, config.hidden_size, config.vocab_size, config.num_hidden_layers, KIND)
    device = model.norm.weight.device
    head = faster_precision(head.to(device))
    shape = head.shape
    return HeadProposer(head, engine_layers(aux_layers), shape.num_aux * shape.hidden_size,
                        to_features=head.fuse, logits=head.logits, embed=model.embed_tokens, device=device,
                        weights=list(head.parameters()),
                        kv_bytes_per_token=2 * shape.num_kv_heads * shape.head_dim * head.fc.weight.element_size(),
                        branches=options.eagle3_branches)


def head_shape(config, width: int | None) -> Eagle3Shape:
    """The head's layer: the target's attention shape, an MLP `width` wide (default: 4/3 of the
    hidden size, a multiple of 64, at most the target's: a draft token then reads ~0.1 of a step)."""
    default = min(config.intermediate_size, -(-config.hidden_size * 4 // 3 // 64) * 64)
    return Eagle3Shape(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                       width or default, config.rope_theta, config.rms_norm_eps)


def train_layers(config) -> tuple[int, ...]:
    return engine_layers(default_aux_layers(config.num_hidden_layers))


def train_eagle3_head(model, tokenizer, target_name: str, examples: list[Example], settings: TrainSettings,
                      folder: Path, notes: dict, progress: bool = True) -> TrainResult:
    """A head over the answers' tokens and the most frequent others (its LM head starting as the
    target's rows of them), trained with training-time test and saved to `folder`."""
    config = model.config
    kept = training_vocabulary(examples, tokenizer, settings)
    torch.manual_seed(settings.seed)
    head = Eagle3Head(head_shape(config, settings.head_width), kept)
    with torch.no_grad():  # its LM head starts as the target's rows (its norm as ones: see eagle3_training.py)
        head.lm_head.weight.copy_(head_rows(model, kept).float().cpu())

    def embed(ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model.embed_tokens(ids.to(model.norm.weight.device)).float().cpu()

    result = train_eagle3(head, lambda ids: embed(ids).clone(), examples, config.vocab_size, settings,
                          folder / "checkpoint.pt", progress)
    save_eagle3(folder, head, config.vocab_size, default_aux_layers(config.num_hidden_layers), target_name,
                max_position_embeddings=config.max_position_embeddings, draftwise={
                    "kind": KIND, "target": target_name, "kept_tokens": len(kept),
                    "target_layers": config.num_hidden_layers,
                    "training": {**notes, "train_positions": result.train_positions,
                                 "heldout_positions": result.heldout_positions, "settings": asdict(settings),
                                 "epochs": [asdict(r) for r in result.reports]}})
    (folder / "checkpoint.pt").unlink(missing_ok=True)  # trained to the end: nothing left to resume
    return result


register(DrafterSpec(KIND, "one decoder layer on three of the target's layers fused, drafting on its own "
                           "(draftwise train-head)", Eagle3Options, build_eagle3, benchmark_by_default=False,
                     train=train_eagle3_head, train_layers=train_layers,
                     train_reads=frozenset({"head_width", "bf16"}), vllm_model_option="head"))
