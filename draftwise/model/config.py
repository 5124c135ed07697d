"""The shape of a Llama-family decoder, read from a Hugging Face `config.json`."""

from __future__ import annotations

from dataclasses import dataclass

from draftwise.errors import ModelFormatError
from draftwise.model.rope import RopeScaling

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


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
                attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                rope_scaling=None if scaling.rope_type == "default" else scaling,
            )
        except KeyError as missing:
            raise ModelFormatError(f"{source}: required field {missing} is missing") from None

    def to_hf_dict(self) -> dict:
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
        }
