"""EAGLE heads on disk, in the layouts vLLM and speculators use.

Written: vLLM's EAGLE-1 layout (`--speculative-config '{"method": "eagle", "model": FOLDER}'`): a
one-layer decoder config (`config.json`, model_type "llama") and `model.safetensors` with `fc.weight`
[H, 2H] (input: the token's embedding, then the target's feature after its final norm) and
`layers.0.*` (no input norm on layer 0, no final norm, no embedding or LM head: the target's are
used). What only draftwise needs (the kept vocabulary, how it was trained) sits under the config's
"draftwise" key, which vLLM ignores.

Read: that layout (ours or one trained elsewhere for the same target), and speculators' EAGLE-1
format (`"speculators_model_type": "eagle"`, speculators 0.1-0.3: `fusion_fc.*`, `transformer.*`).
Refused by name: EAGLE-3 (`"eagle3"`: fused low/middle/high features, its own format:
`eagle3_format.py`), and the HASS variants (`layernorms`, `fusion_bias`), which this head does not compute.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from draftwise.errors import InvalidParameterError, ModelFormatError
from draftwise.speculative.heads.eagle import EagleHead, EagleShape

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
SPECULATORS_EAGLE1 = "eagle"  # speculators' model type of an EAGLE-1 speculator (a field of its format)


def save_eagle(folder: Path, head: EagleHead, vocab_size: int, draftwise: dict,
               max_position_embeddings: int = 32768) -> None:
    """Write `head` in vLLM's EAGLE-1 layout; `draftwise`: what this library keeps beside it (its
    drafter's name under "kind", how it was trained)."""
    shape = head.shape
    q, k, v = head.qkv_proj.weight.split(head.split_sizes)
    gate, up = head.gate_up_proj.weight.chunk(2)
    tensors = {"fc.weight": head.fc.weight,
               "layers.0.self_attn.q_proj.weight": q, "layers.0.self_attn.k_proj.weight": k,
               "layers.0.self_attn.v_proj.weight": v, "layers.0.self_attn.o_proj.weight": head.o_proj.weight,
               "layers.0.post_attention_layernorm.weight": head.post_attention_layernorm,
               "layers.0.mlp.gate_proj.weight": gate, "layers.0.mlp.up_proj.weight": up,
               "layers.0.mlp.down_proj.weight": head.down_proj.weight}
    if shape.attention_bias:
        qb, kb, vb = head.qkv_proj.bias.split(head.split_sizes)
        tensors.update({"layers.0.self_attn.q_proj.bias": qb, "layers.0.self_attn.k_proj.bias": kb,
                        "layers.0.self_attn.v_proj.bias": vb})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim, "rope_theta": shape.rope_theta, "rms_norm_eps": shape.rms_norm_eps,
        "attention_bias": shape.attention_bias, "hidden_act": "silu", "vocab_size": vocab_size,
        "tie_word_embeddings": False, "torch_dtype": "float32", "max_position_embeddings": max_position_embeddings,
        "draftwise": {**draftwise, "kept_ids": head.kept_ids.tolist()},
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: t.detach().float().contiguous() for name, t in tensors.items()}, str(folder / WEIGHTS),
              metadata={"format": "pt"})
    (folder / CONFIG).write_text(json.dumps(config, indent=2))


def read_eagle(folder: Path, hidden_size: int, vocab_size: int, default_kept: Callable[[], torch.Tensor],
               kind: str | None = None) -> tuple[EagleHead, dict]:
    """The head in `folder` (either layout) and its config, checked against the target's hidden size
    and vocabulary. default_kept() [N]: the vocabulary a head from elsewhere scores (ours keep theirs);
    kind: the drafter reading it, refusing a draftwise head saved by another."""
    config_path = folder / CONFIG
    weight_files = head_weight_files(folder, WEIGHTS)
    if not config_path.is_file() or not weight_files:
        raise InvalidParameterError(f"{folder}: not an EAGLE head folder ({CONFIG} and *.safetensors expected)")
    try:
        config = json.loads(config_path.read_text())
        tensors = {name: t for path in weight_files for name, t in load_file(str(path)).items()}
    except (OSError, ValueError, SafetensorError) as error:
        raise ModelFormatError(f"{folder}: unreadable head ({error})") from None
    if not isinstance(config, dict):
        raise ModelFormatError(f"{folder}/{CONFIG}: not a JSON object")
    if "speculators_model_type" in config:
        layer_config, tensors = _from_speculators(folder, config, tensors)
    else:
        saved_as = _ours(folder, config).get("kind")
        if kind is not None and saved_as is not None and saved_as != kind:
            raise InvalidParameterError(f"{folder}: a {saved_as!r} head, not a {kind!r} one")
        if config.get("num_hidden_layers", 1) != 1 or "fc.weight" not in tensors:
            raise InvalidParameterError(f"{folder}: not an EAGLE-1 head (one layer and fc.weight expected)")
        layer_config = config
    shape = _shape(folder, layer_config, "layers.0.self_attn.q_proj.bias" in tensors)
    if shape.hidden_size != hidden_size or layer_config.get("vocab_size", vocab_size) != vocab_size:
        raise InvalidParameterError(
            f"{folder}: made for hidden size {shape.hidden_size} and {layer_config.get('vocab_size')} tokens; "
            f"this target has {hidden_size} and {vocab_size}")
    kept = _ours(folder, config).get("kept_ids")
    kept = default_kept() if kept is None else torch.tensor(kept, dtype=torch.long)
    if kept.numel() == 0 or int(kept.max()) >= vocab_size or int(kept.min()) < 0:
        raise ModelFormatError(f"{folder}: kept token ids outside the vocabulary")
    head = EagleHead(shape, kept)
    try:
        state = {"fc.weight": tensors["fc.weight"],
                 "qkv_proj.weight": torch.cat([tensors[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]),
                 "o_proj.weight": tensors["layers.0.self_attn.o_proj.weight"],
                 "post_attention_layernorm": tensors["layers.0.post_attention_layernorm.weight"],
                 "gate_up_proj.weight": torch.cat([tensors["layers.0.mlp.gate_proj.weight"],
                                                   tensors["layers.0.mlp.up_proj.weight"]]),
                 "down_proj.weight": tensors["layers.0.mlp.down_proj.weight"], "kept_ids": kept}
        if shape.attention_bias:
            state["qkv_proj.bias"] = torch.cat([tensors[f"layers.0.self_attn.{p}_proj.bias"] for p in "qkv"])
        read = {"fc.weight", "layers.0.post_attention_layernorm.weight", "layers.0.self_attn.o_proj.weight",
                *(f"layers.0.self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")),
                *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
                "embed_tokens.weight", "lm_head.weight"}  # (the last two: copies of the target's; its own are used)
        unknown = sorted(set(tensors) - read)
        if unknown:  # (fc.bias, an input norm, QK norms: a head computing what this one does not)
            raise InvalidParameterError(f"{folder}: tensors this EAGLE-1 head does not compute: {', '.join(unknown)}")
        head.load_state_dict({name: t.float() if t.is_floating_point() else t for name, t in state.items()})
    except (KeyError, RuntimeError) as error:
        raise ModelFormatError(f"{folder}: the weights do not match its config ({error})") from None
    return head.eval().requires_grad_(False), config


def _from_speculators(folder: Path, config: dict, tensors: dict) -> tuple[dict, dict]:
    """speculators' EAGLE-1 names and layer config, as vLLM's layout has them."""
    kind = config.get("speculators_model_type")
    if kind == SPECULATORS_EAGLE1 + "3":
        raise InvalidParameterError(f"{folder}: an EAGLE-3 head (fused low, middle and high features): serve it "
                                    "with the EAGLE-3 drafter, not the EAGLE-1 one")
    if kind != SPECULATORS_EAGLE1:
        raise InvalidParameterError(f"{folder}: a speculators {kind!r} model, not an EAGLE head")
    for variant in ("layernorms", "fusion_bias"):
        if config.get(variant):
            raise InvalidParameterError(f"{folder}: {variant}=true (the HASS variant) is not supported")
    renamed, unknown = {}, []
    for name, tensor in tensors.items():
        if name.startswith("fusion_fc."):
            renamed["fc." + name.removeprefix("fusion_fc.")] = tensor
        elif name.startswith("transformer."):
            renamed["layers.0." + name.removeprefix("transformer.")] = tensor
        elif name not in ("embed_tokens.weight", "lm_head.weight"):  # (copies of the target's: its own are used)
            unknown.append(name)
    if unknown:
        raise InvalidParameterError(f"{folder}: tensors this EAGLE head does not compute: {', '.join(sorted(unknown))}")
    layer_config = config.get("transformer_layer_config")
    if not isinstance(layer_config, dict):
        raise ModelFormatError(f"{folder}: speculators config without transformer_layer_config")
    return layer_config, renamed


def refuse_rope_scaling(folder: Path, layer_config: dict) -> None:
    """A head whose layer scales its rotary embedding is refused: draftwise's heads use plain RoPE
    (its positions would be rotated otherwise than it was trained with); so is one whose MLP gate is
    not SiLU (draftwise's heads compute SwiGLU)."""
    activation = layer_config.get("hidden_act", "silu")
    if activation not in ("silu", "swish"):
        raise InvalidParameterError(f"{folder}: the head's hidden_act {activation!r} is not supported: draftwise's "
                                    "head computes SiLU")
    for option in ("rope_scaling", "rope_parameters"):
        scaling = layer_config.get(option)
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise InvalidParameterError(f"{folder}: the head's {option} ({scaling.get('rope_type', scaling.get('type'))}) "
                                        "is not supported: draftwise's head uses plain rotary embedding")


def _shape(folder: Path, config: dict, has_qkv_bias: bool) -> EagleShape:
    """The layer's shape; query/key/value biases where the file has them (a Qwen2 config names none)."""
    refuse_rope_scaling(folder, config)
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return EagleShape(hidden, heads, int(config.get("num_key_value_heads", heads)),
                          int(config.get("head_dim") or hidden // heads), int(config["intermediate_size"]),
                          float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
                                or 10000.0), float(config.get("rms_norm_eps", 1e-6)),
                          has_qkv_bias)
    except (KeyError, TypeError, ValueError) as error:
        raise ModelFormatError(f"{folder}/{CONFIG}: incomplete layer config ({error})") from None


def _ours(folder: Path, config: dict) -> dict:
    """What draftwise recorded in the config (its "draftwise" object; none: empty)."""
    ours = config.get("draftwise")
    if ours is not None and not isinstance(ours, dict):
        raise ModelFormatError(f"{folder}/{CONFIG}: \"draftwise\" must be an object")
    return ours or {}


def head_weight_files(folder: Path, weights: str) -> list[Path]:
    """The head's weight files: `weights` where the folder has it (another head's files left beside it,
    e.g. a Medusa head trained into the same --out, are not this head's), else every *.safetensors
    (a checkpoint from elsewhere, in shards)."""
    return [folder / weights] if (folder / weights).is_file() else sorted(folder.glob("*.safetensors"))
