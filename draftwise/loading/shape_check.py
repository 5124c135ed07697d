"""The config checked against the checkpoint's tensor shapes before a model is built from it.

A config.json (or a GGUF header converted to one) that disagrees with the weights must be named as
such, and before anything is allocated: a layer count or width from a damaged file would otherwise
build a model of millions of layers or terabytes (a hang, or an allocation torch refuses with a
traceback), and a projection of the wrong width would fail inside a concatenation. Only the headers
are read (shapes, no data)."""

from __future__ import annotations

import re
from pathlib import Path

from safetensors import SafetensorError, safe_open

from draftwise.errors import ModelFormatError
from draftwise.loading.weight_files import checkpoint_layout
from draftwise.model.config import ModelConfig

LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape by its name without the "model." prefix (headers only)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file, keys in checkpoint_layout(folder).items():
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in keys:
                    shapes[key.removeprefix("model.")] = tuple(handle.get_slice(key).get_shape())
        except (SafetensorError, OSError) as error:
            raise ModelFormatError(f"{file}: corrupt or truncated safetensors file ({error})") from None
    return shapes


def check_config_against_checkpoint(folder: Path, config: ModelConfig) -> None:
    """Raise ModelFormatError naming the first disagreement between config.json and the weights:
    the layer count, the embedding's shape, each dense layer's projections."""
    shapes = checkpoint_shapes(folder)
    layers = {int(match.group(1)) for name in shapes if (match := LAYER.match(name))}
    source = folder / "config.json"
    if len(layers) != config.num_hidden_layers or (layers and max(layers) != config.num_hidden_layers - 1):
        raise ModelFormatError(f"{source}: num_hidden_layers is {config.num_hidden_layers}, the weights hold "
                               f"{len(layers)} layers")
    hidden, q_width = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_width = config.num_key_value_heads * config.head_dim
    wanted = {"embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_hidden_layers):
        attention, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        wanted.update({attention + "q_proj.weight": (q_width, hidden), attention + "k_proj.weight": (kv_width, hidden),
                       attention + "v_proj.weight": (kv_width, hidden), attention + "o_proj.weight": (hidden, q_width)})
        if not config.is_sparse(i):
            width = config.intermediate_size
            wanted.update({mlp + "gate_proj.weight": (width, hidden), mlp + "up_proj.weight": (width, hidden),
                           mlp + "down_proj.weight": (hidden, width)})
    for name, shape in wanted.items():
        found = shapes.get(name)
        if found is not None and found != shape:  # (a missing one is named when the weights are read)
            raise ModelFormatError(f"{source} disagrees with the weights: {name} is {list(found)}, the config "
                                   f"makes it {list(shape)}")
