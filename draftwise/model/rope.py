"""Rotary position embeddings and their context-extension variants, as Hugging Face defines them
(`transformers.modeling_rope_utils`): the inverse frequencies of each rotated pair, and a factor on
cos and sin.

- default: inv_freq_i = theta^(-2i / D).
- linear (position interpolation): inv_freq / factor.
- llama3 (Llama 3.1+): long wavelengths (past original / low_freq_factor) divided by factor, short
  ones (under original / high_freq_factor) kept, the band between interpolated smoothly.
- yarn: per pair, interpolated (inv_freq / factor) or extrapolated (inv_freq) by a linear ramp
  between the pairs whose wavelengths fit beta_fast and beta_slow rotations in the original context;
  cos and sin scaled by the attention factor (0.1 ln(factor) + 1, or as mscale / mscale_all_dim say).

Refused by name: "dynamic" (NTK scaling recomputed from the length of the current pass) and
"longrope" (factors chosen by the current length): a position's rotation would depend on how many
tokens share its pass, so verifying k drafted tokens would not compute what k steps compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from draftwise.errors import ModelFormatError

SUPPORTED = ("default", "linear", "llama3", "yarn")
LENGTH_DEPENDENT = ("dynamic", "longrope")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn (None: from factor, mscale, mscale_all_dim)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the ramp's ends outward
    freq_factors: tuple[float, ...] | None = None  # per pair, dividing inv_freq (a GGUF's rope_freqs tensor)

    def to_hf(self) -> dict:
        """As config.json's `rope_scaling` (freq_factors under a key of draftwise's own)."""
        fields = {"rope_type": self.rope_type, "factor": self.factor,
                  "original_max_position_embeddings": self.original_max_position_embeddings,
                  "low_freq_factor": self.low_freq_factor, "high_freq_factor": self.high_freq_factor,
                  "beta_fast": self.beta_fast, "beta_slow": self.beta_slow, "attention_factor": self.attention_factor,
                  "mscale": self.mscale, "mscale_all_dim": self.mscale_all_dim, "truncate": self.truncate}
        if self.freq_factors is not None:
            fields["draftwise_freq_factors"] = list(self.freq_factors)
        return {key: value for key, value in fields.items() if value is not None}

    @classmethod
    def from_hf(cls, rope: dict, max_position_embeddings: int, source: str) -> "RopeScaling":
        """From config.json's `rope_scaling` (older) or `rope_parameters` (transformers >= 5)."""
        kind = rope.get("rope_type", rope.get("type")) or "default"
        if kind in LENGTH_DEPENDENT:
            raise ModelFormatError(f"{source}: RoPE scaling {kind!r} makes a position's rotation depend on the "
                                   "length of the pass it is in, which speculation cannot verify losslessly; "
                                   f"supported: {', '.join(SUPPORTED)}")
        if kind not in SUPPORTED:
            raise ModelFormatError(f"{source}: RoPE scaling {kind!r} is not supported (supported: "
                                   f"{', '.join(SUPPORTED)})")
        if kind == "default":
            return cls()
        try:
            factor = rope.get("factor")
            original = rope.get("original_max_position_embeddings")
            if kind == "yarn" and factor is None:
                factor = max_position_embeddings / original
            scaling = cls(kind, float(factor), None if original is None else int(original),
                          float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0)),
                          float(rope.get("beta_fast") or 32.0), float(rope.get("beta_slow") or 1.0),
                          None if rope.get("attention_factor") is None else float(rope["attention_factor"]),
                          rope.get("mscale"), rope.get("mscale_all_dim"), bool(rope.get("truncate", True)),
                          None if rope.get("draftwise_freq_factors") is None
                          else tuple(float(f) for f in rope["draftwise_freq_factors"]))
        except (TypeError, ValueError, KeyError) as error:
            raise ModelFormatError(f"{source}: RoPE scaling {rope}: {error}") from None
        if kind in ("llama3", "yarn") and scaling.original_max_position_embeddings is None \
                and scaling.freq_factors is None:
            raise ModelFormatError(f"{source}: RoPE scaling {kind!r} needs original_max_position_embeddings")
        return scaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """inv_freq [D/2] (float32, on the CPU whatever device is the default) and the factor on cos and sin."""
    with torch.device("cpu"):
        return _inverse_frequencies(head_dim, theta, scaling)


def _inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    if scaling is not None and scaling.freq_factors is not None:  # (a GGUF's rope_freqs tensor: llama3's, computed)
        base, _ = _inverse_frequencies(head_dim, theta, None)
        return base / torch.tensor(scaling.freq_factors, dtype=torch.float32), 1.0
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)  # [D/2]
    if scaling is None or scaling.rope_type == "default":
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return _yarn(head_dim, theta, scaling)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old_context = s.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context / s.low_freq_factor, old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.attention_factor
    if attention_factor is None:
        attention_factor = (mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
                            if s.mscale and s.mscale_all_dim else mscale(s.factor))

    def correction_dim(rotations: float) -> float:  # the pair index that turns `rotations` times in the context
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (no division by zero)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    kept = 1 - ramp  # the share of each pair left as it was trained
    return interpolated * (1 - kept) + extrapolated * kept, float(attention_factor)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, S, D] for positions [B, S] (the half-split layout of Hugging Face Llama)."""
    angles = positions[..., None].float() * inv_freq.to(positions.device)  # [B, S, D/2]
    angles = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, S, D]
    if attention_factor == 1.0:
        return angles.cos().to(dtype), angles.sin().to(dtype)
    return (angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)
