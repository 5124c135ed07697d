"""EAGLE-3 heads on disk, in speculators' format (the one vLLM reads with `"method": "eagle3"`).

Written: `config.json` with `"speculators_model_type": "eagle3"`, the head's layer as a Llama
`transformer_layer_config`, `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids` (the target
layers whose *input* residual stream is fused, vLLM's and speculators' numbering), the verifier;
`model.safetensors` with `fc.weight` [H, 3H], `layers.0.*` (`input_layernorm` on the embedding,
`hidden_norm` on the feature, q/k/v over both [*, 2H], the MLP), `norm.weight`, `lm_head.weight`
[N, H] and the vocabulary maps `d2t` (draft id -> target id - draft id) and `t2d` (target id ->
in the draft vocabulary). What only draftwise needs sits under the config's "draftwise" key.

Read: that format, and the EAGLE-3 repository's layout (a Llama config with `draft_vocab_size`,
weights under `midlayer.*`). Refused by name: more than one layer, the options this head does not
compute (`norm_before_fc`, `fc_norm`, `norm_output`), and tensors it would ignore.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from draftwise.errors import InvalidParameterError, ModelFormatError
from draftwise.speculative.heads.eagle3 import Eagle3Head, Eagle3Shape
from draftwise.speculative.heads.eagle_format import head_weight_files, refuse_rope_scaling

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
SPECULATORS_TYPE = "eagle3"  # speculators' model type (a field of its format)
UNSUPPORTED_OPTIONS = ("norm_before_fc", "fc_norm", "norm_output")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The layers whose input streams EAGLE-3 fuses by default: vLLM's and speculators' choice (2,
    L/2, L-3); for models of under six layers the first, the middle and the last output."""
    if num_layers >= 6:
        return 2, num_layers // 2, num_layers - 3
    return 1, (num_layers + 1) // 2, num_layers


def save_eagle3(folder: Path, head: Eagle3Head, vocab_size: int, aux_layers: tuple[int, ...], verifier: str,
                draftwise: dict, max_position_embeddings: int = 32768) -> None:
    """Write `head` in speculators' EAGLE-3 format; aux_layers: speculators' numbering (inputs of
    those layers); verifier: the target's name; draftwise: what this library keeps beside it."""
    shape = head.shape
    q, k, v = head.qkv_proj.weight.split(head.split_sizes)
    gate, up = head.gate_up_proj.weight.chunk(2)
    kept = head.kept_ids.long()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    tensors = {"fc.weight": head.fc.weight,
               "layers.0.input_layernorm.weight": head.input_layernorm, "layers.0.hidden_norm.weight": head.hidden_norm,
               "layers.0.self_attn.q_proj.weight": q, "layers.0.self_attn.k_proj.weight": k,
               "layers.0.self_attn.v_proj.weight": v, "layers.0.self_attn.o_proj.weight": head.o_proj.weight,
               "layers.0.post_attention_layernorm.weight": head.post_attention_layernorm,
               "layers.0.mlp.gate_proj.weight": gate, "layers.0.mlp.up_proj.weight": up,
               "layers.0.mlp.down_proj.weight": head.down_proj.weight,
               "norm.weight": head.norm, "lm_head.weight": head.lm_head.weight}
    tensors = {name: t.detach().float().contiguous() for name, t in tensors.items()}
    tensors["d2t"] = (kept - torch.arange(len(kept))).contiguous()
    tensors["t2d"] = t2d
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": SPECULATORS_TYPE,
        "draft_vocab_size": len(kept), "norm_before_residual": shape.norm_before_residual,
        "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": list(aux_layers),
        "transformer_layer_config": {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
            "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
            "num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim, "rope_theta": shape.rope_theta, "rms_norm_eps": shape.rms_norm_eps,
            "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "vocab_size": vocab_size,
            "tie_word_embeddings": False, "max_position_embeddings": max_position_embeddings},
        "speculators_config": {
            "algorithm": SPECULATORS_TYPE, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": verifier, "architectures": []}},
        "torch_dtype": "float32",
        "draftwise": draftwise,
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / CONFIG).write_text(json.dumps(config, indent=2))


def read_eagle3(folder: Path, hidden_size: int, vocab_size: int, num_layers: int,
                kind: str | None = None) -> tuple[Eagle3Head, tuple[int, ...], dict]:
    """The head in `folder`, the target layers it fuses (speculators' numbering) and its config,
    checked against the target's hidden size, vocabulary and depth; kind: the drafter reading it,
    refusing a draftwise head saved by another."""
    config_path = folder / CONFIG
    weight_files = head_weight_files(folder, WEIGHTS)
    if config_path.is_file() and not weight_files and any(folder.glob("*.bin")):
        raise InvalidParameterError(f"{folder}: weights in PyTorch's pickle format (*.bin); draftwise reads "
                                    "safetensors only (convert them, e.g. with safetensors.torch.save_file)")
    if not config_path.is_file() or not weight_files:
        raise InvalidParameterError(f"{folder}: not an EAGLE-3 head folder ({CONFIG} and *.safetensors expected)")
    try:
        config = json.loads(config_path.read_text())
        tensors = {name: t for path in weight_files for name, t in load_file(str(path)).items()}
    except (OSError, ValueError, SafetensorError) as error:
        raise ModelFormatError(f"{folder}: unreadable head ({error})") from None
    if not isinstance(config, dict):
        raise ModelFormatError(f"{folder}/{CONFIG}: not a JSON object")
    ours = config.get("draftwise") or {}
    saved_as = ours.get("kind") if isinstance(ours, dict) else None
    if kind is not None and saved_as is not None and saved_as != kind:
        raise InvalidParameterError(f"{folder}: a {saved_as!r} head, not a {kind!r} one")
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != SPECULATORS_TYPE:
            raise InvalidParameterError(f"{folder}: a speculators {config['speculators_model_type']!r} model, "
                                        f"not an EAGLE-3 head")
        layer_config = config.get("transformer_layer_config")
        if not isinstance(layer_config, dict):
            raise ModelFormatError(f"{folder}: speculators config without transformer_layer_config")
    else:  # the EAGLE-3 repository's layout: the layer's config at the top
        layer_config = config
        if "draft_vocab_size" not in config:
            raise InvalidParameterError(f"{folder}: not an EAGLE-3 head (no speculators_model_type, no draft_vocab_size)")
    for option in UNSUPPORTED_OPTIONS:
        if config.get(option):
            raise InvalidParameterError(f"{folder}: {option}=true is not supported by draftwise's EAGLE-3 head")
    refuse_rope_scaling(folder, layer_config)
    if layer_config.get("num_hidden_layers", 1) != 1:
        raise InvalidParameterError(f"{folder}: an EAGLE-3 head of {layer_config['num_hidden_layers']!r} layers; "
                                    "draftwise serves one-layer heads")
    tensors = {("layers.0." + name.removeprefix("midlayer.")) if name.startswith("midlayer.") else name: t
               for name, t in tensors.items()}
    made_for = ours.get("target_layers") if isinstance(ours, dict) else None
    if made_for is not None and made_for != num_layers:  # (its layer ids would read other layers of this one)
        raise InvalidParameterError(f"{folder}: made for a target of {made_for} layers; this target has {num_layers}")
    aux = config.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(num_layers)
    if not isinstance(aux, (list, tuple)) or len(aux) != 3 \
            or not all(isinstance(i, int) and not isinstance(i, bool) and 1 <= i <= num_layers for i in aux):
        raise InvalidParameterError(f"{folder}: eagle_aux_hidden_state_layer_ids {aux} do not fit a target of "
                                    f"{num_layers} layers (three ids in 1..{num_layers})")
    # (speculators' configs leave it out where it is on, as vLLM reads them; the EAGLE-3 repository's where off)
    norm_before_residual = config.get("norm_before_residual", "speculators_model_type" in config)
    shape = _shape(folder, layer_config, bool(norm_before_residual))
    target_hidden = config.get("target_hidden_size") or shape.hidden_size
    if shape.hidden_size != hidden_size or target_hidden != hidden_size \
            or _count(folder, layer_config.get("vocab_size", vocab_size), "vocab_size") != vocab_size:
        raise InvalidParameterError(
            f"{folder}: made for hidden size {target_hidden} and {layer_config.get('vocab_size')} tokens; "
            f"this target has {hidden_size} and {vocab_size}")
    kept = _draft_vocabulary(folder, tensors, vocab_size)
    said = config.get("draft_vocab_size", layer_config.get("draft_vocab_size"))
    if said is not None and said != len(kept):
        raise ModelFormatError(f"{folder}: draft_vocab_size {said!r}, but lm_head.weight scores {len(kept)} tokens")
    head = Eagle3Head(shape, kept)
    try:
        state = {"fc.weight": tensors["fc.weight"],
                 "input_layernorm": tensors["layers.0.input_layernorm.weight"],
                 "hidden_norm": tensors["layers.0.hidden_norm.weight"],
                 "qkv_proj.weight": torch.cat([tensors[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]),
                 "o_proj.weight": tensors["layers.0.self_attn.o_proj.weight"],
                 "post_attention_layernorm": tensors["layers.0.post_attention_layernorm.weight"],
                 "gate_up_proj.weight": torch.cat([tensors["layers.0.mlp.gate_proj.weight"],
                                                   tensors["layers.0.mlp.up_proj.weight"]]),
                 "down_proj.weight": tensors["layers.0.mlp.down_proj.weight"],
                 "norm": tensors["norm.weight"], "lm_head.weight": tensors["lm_head.weight"], "kept_ids": kept}
        read = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                *(f"layers.0.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
                *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
                *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
                "embed_tokens.weight"}  # (a copy of the target's: its own is used)
        unknown = sorted(set(tensors) - read)
        if unknown:  # (biases, QK norms, fc norms: a head computing what this one does not)
            raise InvalidParameterError(f"{folder}: tensors this EAGLE-3 head does not compute: {', '.join(unknown)}")
        head.load_state_dict({name: t.float() if t.is_floating_point() else t for name, t in state.items()})
    except (KeyError, RuntimeError) as error:
        raise ModelFormatError(f"{folder}: the weights do not match its config ({error})") from None
    return head.eval().requires_grad_(False), tuple(aux), config


def _draft_vocabulary(folder: Path, tensors: dict, vocab_size: int) -> torch.Tensor:
    """[N] the target ids of the draft vocabulary: d2t's offsets, or the whole vocabulary without one."""
    rows = tensors.get("lm_head.weight")
    if rows is None:
        raise ModelFormatError(f"{folder}: no lm_head.weight")
    if "d2t" not in tensors:
        if rows.shape[0] != vocab_size:
            raise ModelFormatError(f"{folder}: a draft vocabulary of {rows.shape[0]} tokens without d2t")
        return torch.arange(vocab_size)
    offsets = tensors["d2t"].long()
    kept = offsets + torch.arange(len(offsets))
    if len(kept) != rows.shape[0] or int(kept.min()) < 0 or int(kept.max()) >= vocab_size \
            or len(torch.unique(kept)) != len(kept):
        raise ModelFormatError(f"{folder}: d2t does not map {rows.shape[0]} draft ids onto distinct target ids")
    return kept


def _shape(folder: Path, config: dict, norm_before_residual: bool) -> Eagle3Shape:
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise InvalidParameterError(f"{folder}: biases in the head's layer are not supported")
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return Eagle3Shape(hidden, heads, int(config.get("num_key_value_heads", heads)),
                           int(config.get("head_dim") or hidden // heads), int(config["intermediate_size"]),
                           float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
                                 or 10000.0), float(config.get("rms_norm_eps", 1e-6)),
                           norm_before_residual=norm_before_residual)
    except (KeyError, TypeError, ValueError) as error:
        raise ModelFormatError(f"{folder}/{CONFIG}: incomplete layer config ({error})") from None


def _count(folder: Path, value, name: str) -> int:
    """A positive integer field of the config, or a ModelFormatError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelFormatError(f"{folder}: {name} must be a positive integer, got {value!r}")
    return value
