"""The shape of a Llama-family decoder, read from a Hugging Face `config.json`."""

from __future__ import annotations

from dataclasses import dataclass

from draftwise.errors import ModelFormatError
from draftwise.model.rope import RopeScaling

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "mixtral", "qwen2_moe")


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

    def is_sparse(self, layer_index: int) -> bool:
        """Whether this layer's feed-forward block is a mixture of experts."""
        return (self.num_experts > 0 and layer_index not in self.mlp_only_layers
                and (layer_index + 1) % self.decoder_sparse_step == 0)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelFormatError(
                f"model type {self.model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelFormatError(
                f"{self.num_attention_heads} attention heads do not divide into "
                f"{self.num_key_value_heads} key/value heads"
            )

    @classmethod
    def from_hf_dict(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        try:
            model_type = cfg["model_type"]
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            # transformers >= 5 writes rope_parameters; older files rope_theta and rope_scaling.
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            max_positions = int(cfg.get("max_position_embeddings", 4096))
            scaling = RopeScaling.from_hf(rope, max_positions, source)
            rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
            return cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                max_position_embeddings=max_positions,
                attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", model_type in ("qwen2", "qwen2_moe")))),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                rope_scaling=None if scaling.rope_type == "default" else scaling,
                **_moe_fields(cfg, model_type),
            )
        except KeyError as missing:
            raise ModelFormatError(f"{source}: required field {missing} is missing") from None

    def to_hf_dict(self) -> dict:
        """config.json for a converted model (the MoE fields under Qwen2-MoE's names, which read back)."""
        return {
            "architectures": [{"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}.get(
                self.model_type, "LlamaForCausalLM")],
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
            **({"rope_scaling": self.rope_scaling.to_hf()} if self.rope_scaling is not None else {}),
            **({"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob, "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers)} if self.num_experts else {}),
        }


def _moe_fields(cfg: dict, model_type: str) -> dict:
    """ModelConfig's mixture-of-experts fields from a config.json (none for a dense model)."""
    if model_type == "mixtral":  # (transformers' names, or the ones `to_hf_dict` writes)
        return {"num_experts": int(cfg.get("num_local_experts") or cfg["num_experts"]),
                "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
                "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                "norm_topk_prob": True, "mlp_only_layers": tuple(int(i) for i in cfg.get("mlp_only_layers") or ())}
    if model_type == "qwen2_moe" or cfg.get("num_experts"):
        return {"num_experts": int(cfg["num_experts"]), "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
                "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
                "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0),
                "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
                "decoder_sparse_step": int(cfg.get("decoder_sparse_step") or 1),
                "mlp_only_layers": tuple(int(i) for i in cfg.get("mlp_only_layers") or ())}
    return {}
