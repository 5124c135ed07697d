"""The shape of a decoder, read from a Hugging Face `config.json`: the Llama family (Llama, Qwen2,
Mistral), Qwen3 (norms on queries and keys), Gemma 3 (text) and mixtures of experts (Mixtral,
Qwen2-MoE, Qwen3-MoE)."""

from __future__ import annotations

import math

from collections.abc import Iterator
from dataclasses import dataclass

from draftwise.errors import ModelFormatError
from draftwise.model.rope import RopeScaling

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "mixtral", "qwen2_moe", "qwen3", "qwen3_moe", "gemma3_text")
SLIDING, FULL = "sliding_attention", "full_attention"  # config.json's layer types


@dataclass(slots=True, frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2 does)
    tie_word_embeddings: bool  # LM head shares the token embedding matrix
    rope_scaling: RopeScaling | None = None  # None: plain RoPE (`model/rope.py`)
    # mixture of experts (`model/moe.py`; 0 experts: every layer dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's width
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    norm_topk_prob: bool = True  # renormalise the top k weights (Mixtral always; Qwen2-MoE as configured)
    decoder_sparse_step: int = 1  # every n-th layer is sparse (Qwen2-MoE)
    mlp_only_layers: tuple[int, ...] = ()  # dense layers among them (Qwen2-MoE)
    # Qwen3 and Gemma 3
    qk_norm: bool = False  # an RMSNorm over each head's query and key, before RoPE
    # Gemma 3
    sandwich_norms: bool = False  # norms on what attention and the MLP add too (pre- and post-norms)
    norm_weight_offset: float = 0.0  # checkpoints store w where a norm scales by (offset + w): Gemma's 1
    embedding_multiplier: float = 1.0  # token embeddings scaled (Gemma: sqrt(hidden_size))
    hidden_act: str = "silu"  # the MLP's gate: silu (SwiGLU) or gelu_tanh (GeGLU)
    query_pre_attn_scalar: float | None = None  # attention scores scaled by its -1/2 power (None: head_dim's)
    sliding_window: int = 0  # a sliding layer's query sees this many keys, itself included
    layer_types: tuple[str, ...] = ()  # per layer SLIDING or FULL (empty: all full)
    local_rope_theta: float | None = None  # sliding layers' RoPE base (plain RoPE; None: rope_theta's)

    def is_sparse(self, layer_index: int) -> bool:
        """Whether this layer's feed-forward block is a mixture of experts."""
        return (self.num_experts > 0 and layer_index not in self.mlp_only_layers
                and (layer_index + 1) % self.decoder_sparse_step == 0)

    def is_sliding(self, layer_index: int) -> bool:
        """Whether this layer attends over a sliding window of `sliding_window` keys."""
        return bool(self.layer_types) and self.layer_types[layer_index] == SLIDING and self.sliding_window > 0

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelFormatError(
                f"model type {self.model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        for name in _POSITIVE:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelFormatError(f"{name} must be a positive integer, got {value!r}")
        for name, bound in _AT_MOST.items():
            if getattr(self, name) > bound:
                raise ModelFormatError(f"{name} is {getattr(self, name)}: past any model's ({bound} at most); "
                                       "the file is damaged")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelFormatError(
                f"{self.num_attention_heads} attention heads do not divide into "
                f"{self.num_key_value_heads} key/value heads"
            )
        if self.hidden_act not in HIDDEN_ACTIVATIONS:
            raise ModelFormatError(f"hidden activation {self.hidden_act!r} is not supported "
                                   f"(supported: {', '.join(HIDDEN_ACTIVATIONS)})")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ModelFormatError(f"{name} must be a positive number, got {value!r}")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ModelFormatError(f"{len(self.layer_types)} layer types for {self.num_hidden_layers} layers")

    @classmethod
    def from_hf_dict(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        _refuse_unsupported_fields(cfg, source)
        try:
            model_type = cfg["model_type"]
            heads = _integer(cfg["num_attention_heads"], "num_attention_heads")
            hidden = _integer(cfg["hidden_size"], "hidden_size")
            # transformers >= 5 writes rope_parameters; older files rope_theta and rope_scaling.
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            if FULL in rope:  # (per layer type: Gemma 3's in transformers >= 5)
                rope = rope[FULL]
            max_positions = int(cfg.get("max_position_embeddings", 4096))
            scaling = RopeScaling.from_hf(rope, max_positions, source)
            rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
            return cls(
                model_type=model_type,
                vocab_size=_integer(cfg["vocab_size"], "vocab_size"),
                hidden_size=hidden,
                intermediate_size=_integer(cfg["intermediate_size"], "intermediate_size"),
                num_hidden_layers=_integer(cfg["num_hidden_layers"], "num_hidden_layers"),
                num_attention_heads=heads,
                num_key_value_heads=_integer(cfg.get("num_key_value_heads") or heads, "num_key_value_heads"),
                head_dim=_integer(cfg.get("head_dim") or hidden // heads, "head_dim"),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                max_position_embeddings=max_positions,
                attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", model_type in ("qwen2", "qwen2_moe")))),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type == "gemma3_text")),
                rope_scaling=None if scaling.rope_type == "default" else scaling,
                qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
                hidden_act=_activation(cfg, model_type, source),
                **_moe_fields(cfg, model_type),
                **(_gemma3_fields(cfg, hidden) if model_type == "gemma3_text" else {}),
                **(_mistral_window(cfg) if model_type == "mistral" else {}),
            )
        except KeyError as missing:
            raise ModelFormatError(f"{source}: required field {missing} is missing") from None
        except (TypeError, ValueError, ZeroDivisionError, AttributeError) as error:
            raise ModelFormatError(f"{source}: a malformed value ({error})") from None
        except ModelFormatError as error:
            raise (error if source in str(error) else ModelFormatError(f"{source}: {error}")) from None

    def to_hf_dict(self) -> dict:
        """config.json for a converted model (the MoE fields under Qwen2-MoE's names, which read back)."""
        return {
            "architectures": [{"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                               "gemma3_text": "Gemma3ForCausalLM"}.get(self.model_type, "LlamaForCausalLM")],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": _HF_ACTIVATION_NAMES[self.hidden_act],
            **({"rope_scaling": self.rope_scaling.to_hf()} if self.rope_scaling is not None else {}),
            **(self._gemma3_hf_fields() if self.model_type == "gemma3_text" else {}),
            **({"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob, "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers)} if self.num_experts else {}),
        }

    def _gemma3_hf_fields(self) -> dict:
        local = {"rope_type": "default", "rope_theta": self.local_rope_theta or self.rope_theta}
        full = self.rope_scaling.to_hf() if self.rope_scaling is not None else {"rope_type": "default"}
        return {"hidden_activation": _HF_ACTIVATION_NAMES[self.hidden_act],
                "query_pre_attn_scalar": self.query_pre_attn_scalar,
                "sliding_window": self.sliding_window, "layer_types": list(self.layer_types),
                "rope_parameters": {SLIDING: local, FULL: {**full, "rope_theta": self.rope_theta}},
                "rope_local_base_freq": local["rope_theta"]}


def _integer(value, name: str) -> int:
    """A size from config.json: an integer, or a float with nothing after the point (some writers
    emit 2048.0); 64.5 is refused, not cut to 64."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or isinstance(value, float) and (not math.isfinite(value) or not value.is_integer())):
        raise ModelFormatError(f"{name} must be an integer, got {value!r}")
    return int(value)


HIDDEN_ACTIVATIONS = ("silu", "gelu_tanh")
# config.json's names for them (transformers' ACT2FN: "swish" is SiLU; plain "gelu" is the exact erf one,
# which the MLP does not compute) and the name each is written back under.
_ACTIVATION_NAMES = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
_HF_ACTIVATION_NAMES = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}


_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings")
# Far past any released model (Llama 3.1 405B: 126 layers, width 16,384, MLP 53,248; vocabularies to
# ~262k): a value above its bound is a damaged file, refused before anything of that size is built.
_AT_MOST = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 20, "num_hidden_layers": 1 << 10,
            "num_attention_heads": 1 << 10, "num_key_value_heads": 1 << 10, "head_dim": 1 << 11,
            "num_experts": 1 << 12, "moe_intermediate_size": 1 << 20, "shared_expert_intermediate_size": 1 << 20}


def _refuse_unsupported_fields(cfg: dict, source: str) -> None:
    """Fields that would change what the model computes and that this engine does not implement."""
    if not isinstance(cfg, dict):
        raise ModelFormatError(f"{source}: not a JSON object")
    if cfg.get("quantization_config"):
        method = (cfg["quantization_config"] or {}).get("quant_method", "?") \
            if isinstance(cfg["quantization_config"], dict) else "?"
        raise ModelFormatError(f"{source}: a pre-quantized checkpoint ({method}) is not supported; load the model's "
                               "float weights or a GGUF file (quantization= quantizes them here)")
    if cfg.get("model_type") == "gemma3":
        raise ModelFormatError(f"{source}: model type 'gemma3' (the multimodal Gemma 3) is not supported; "
                               "its text-only model, 'gemma3_text', is")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(name) is not None:
            raise ModelFormatError(f"{source}: {name} is not supported (Gemma 2's logit soft-capping)")
    if cfg.get("use_sliding_window") and cfg.get("model_type") != "gemma3_text":
        raise ModelFormatError(f"{source}: use_sliding_window is not supported for {cfg.get('model_type')!r}")
    for where, fields in _rope_field_groups(cfg):
        factor = fields.get("partial_rotary_factor")
        if factor is not None and factor != 1.0:  # (`model/rope.py` rotates every dimension of a head)
            raise ModelFormatError(f"{source}: {where}partial_rotary_factor {factor!r} is not supported (RoPE "
                                   "over a part of each head is not implemented)")


def _rope_field_groups(cfg: dict) -> Iterator[tuple[str, dict]]:
    """Where RoPE settings may sit: the top level, rope_parameters / rope_scaling, and (transformers >= 5,
    Gemma 3) their per-layer-type dicts; each with the prefix that names it in an error."""
    yield "", cfg
    for key in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(key)
        if isinstance(rope, dict):
            yield f"{key}.", rope
            for layer_type in (SLIDING, FULL):
                if isinstance(rope.get(layer_type), dict):
                    yield f"{key}.{layer_type}.", rope[layer_type]


def _activation(cfg: dict, model_type: str, source: str) -> str:
    """The MLP gate's activation by our name, from hidden_activation (Gemma's field) or hidden_act;
    any other would be computed as SiLU or GELU-tanh all the same, so it is refused by name."""
    field = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
    value = cfg.get(field) or ("gelu_pytorch_tanh" if model_type == "gemma3_text" else "silu")
    if isinstance(value, str) and value in _ACTIVATION_NAMES:
        return _ACTIVATION_NAMES[value]
    raise ModelFormatError(f"{source}: {field} {value!r} is not supported (supported: "
                           f"{', '.join(_ACTIVATION_NAMES)})")


def _gemma3_fields(cfg: dict, hidden: int) -> dict:
    """ModelConfig's Gemma 3 fields from a config.json (transformers 4.5x or 5.x names)."""
    layers = int(cfg["num_hidden_layers"])
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    layer_types = tuple(cfg.get("layer_types") or (
        FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)))
    local = (cfg.get("rope_parameters") or {}).get(SLIDING, {}).get("rope_theta", cfg.get("rope_local_base_freq"))
    return {"sandwich_norms": True, "norm_weight_offset": 1.0, "embedding_multiplier": hidden ** 0.5,
            "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256),
            "sliding_window": int(cfg.get("sliding_window") or 0), "layer_types": layer_types,
            "local_rope_theta": float(local) if local is not None else 10000.0}


def _mistral_window(cfg: dict) -> dict:
    """Mistral's sliding window (7B v0.1: 4096): every layer's query sees that many keys, itself
    included (transformers' and vLLM's reading); none where it is null."""
    window = cfg.get("sliding_window")
    if window is None:
        return {}
    layers = int(cfg["num_hidden_layers"])
    return {"sliding_window": int(window), "layer_types": (SLIDING,) * layers}


def _moe_fields(cfg: dict, model_type: str) -> dict:
    """ModelConfig's mixture-of-experts fields from a config.json (none for a dense model)."""
    if model_type == "mixtral":  # (transformers' names, or the ones `to_hf_dict` writes)
        return {"num_experts": int(cfg.get("num_local_experts") or cfg["num_experts"]),
                "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
                "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                "norm_topk_prob": True, "mlp_only_layers": tuple(int(i) for i in cfg.get("mlp_only_layers") or ())}
    if model_type in ("qwen2_moe", "qwen3_moe") or cfg.get("num_experts"):
        return {"num_experts": int(cfg.get("num_experts") or cfg["num_local_experts"]), "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
                "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
                "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0),
                "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
                "decoder_sparse_step": int(cfg.get("decoder_sparse_step") or 1),
                "mlp_only_layers": tuple(int(i) for i in cfg.get("mlp_only_layers") or ())}
    return {}
