"""Read a GGUF file: model shape, tokenizer metadata and dequantized tensors under Hugging Face names."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from draftwise.errors import ModelFormatError, ModelNotFoundError
from draftwise.model.config import ModelConfig
from draftwise.model.rope import RopeScaling

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "gemma3")  # (llama with experts: Mixtral)
# A mixture of experts' tensors: the router, the experts stacked [E, out, in], a shared expert and its gate.
_EXPERT_TENSORS = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up", "ffn_down_exps.weight": "down"}
_SHARED_TENSORS = {"ffn_gate_shexp.weight": "gate", "ffn_up_shexp.weight": "up", "ffn_down_shexp.weight": "down"}

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3, Gemma 3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Gemma 3 norms each sublayer's input and output: its ffn_norm is the MLP's input norm.
_GEMMA3_TENSORS = {**_LAYER_TENSORS, "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                   "post_attention_norm.weight": "post_attention_layernorm.weight",
                   "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# llama.cpp's Gemma 3 constants that its files do not carry (llama-model.cpp).
GEMMA3_SLIDING_PATTERN = 6  # every sixth layer global, the others sliding
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_NORM_SHIFT = 1.0  # the converter stores 1 + w for each norm (Gemma scales by 1 + w)
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def _is_expert_tensor(gguf_name: str) -> bool:
    match = _LAYER_NAME.fullmatch(gguf_name)
    return bool(match) and (match.group(2) in _EXPERT_TENSORS or match.group(2) in _SHARED_TENSORS
                            or match.group(2) in ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    layer_tensors = _GEMMA3_TENSORS if architecture == "gemma3" else _LAYER_TENSORS
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in layer_tensors:
        return f"model.layers.{match.group(1)}.{layer_tensors[match.group(2)]}"
    return None


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE reordering of Q/K rows ([out, in] or bias [out])."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def permute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows of `llama` models (the inverse of the above)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


@dataclass(slots=True)
class GGUFTensor:
    name: str  # Hugging Face name
    type_name: str  # how the file stores it: F32, Q4_K, Q6_K, ...
    weight: np.ndarray  # float32, PyTorch's [out, in] layout
    q4k_groups: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # (quants, scales, minimums) if stored as Q4_K
    # Q4_K: its factors (`q4k_factors`); Q6_K: its integers (`q6k_values`); per row, like the weight
    superblocks: dict[str, np.ndarray] | None = None


class GGUFFile:
    def __init__(self, path: Path) -> None:
        import gguf  # imported here: only conversion needs it

        self.path = path
        if not path.is_file():
            raise ModelNotFoundError(f"{path}: no such file")
        try:
            with open(path, "rb") as handle:
                magic = handle.read(4)
        except OSError as error:
            raise ModelFormatError(f"{path}: cannot be read ({error.strerror or error})") from None
        if magic != b"GGUF":
            raise ModelFormatError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        try:
            self._reader = gguf.GGUFReader(str(path))
        except Exception as error:  # the reader raises bare ValueError/IndexError on damaged files
            raise ModelFormatError(f"{path}: corrupt or truncated GGUF file ({type(error).__name__}: {error})") from None
        self.metadata = {name: self._field(name) for name in self._reader.fields if not name.startswith("GGUF.")}
        self._check_extents()
        self.architecture = self.metadata.get("general.architecture")
        if self.metadata.get("general.type") == "adapter":
            raise ModelFormatError(f"{path}: a LoRA adapter, not a model (load its base model; adapters are not "
                                   "supported)")
        if int(self.metadata.get("split.count") or 1) > 1:
            raise ModelFormatError(
                f"{path}: part {int(self.metadata.get('split.no') or 0) + 1} of a GGUF split into "
                f"{int(self.metadata['split.count'])} files; merge them first (llama.cpp: `llama-gguf-split "
                "--merge FIRST-PART OUT.gguf`)")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelFormatError(
                f"{path}: architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        try:
            self.config = self._config()
        except KeyError as missing:
            raise ModelFormatError(f"{path}: metadata {missing} is missing") from None
        except ZeroDivisionError:
            raise ModelFormatError(f"{path}: metadata {self.architecture}.attention.head_count is 0") from None
        except (TypeError, ValueError) as error:
            raise ModelFormatError(f"{path}: malformed metadata ({error})") from None
        except ModelFormatError as error:
            raise (error if str(path) in str(error) else ModelFormatError(f"{path}: {error}")) from None

    def _field(self, name: str):
        try:
            return self._reader.fields[name].contents()
        except Exception as error:
            raise ModelFormatError(f"{self.path}: metadata field {name!r} is unreadable ({error})") from None

    def _check_extents(self) -> None:
        """Every tensor inside the file, at its alignment, and none overlapping another (a damaged
        offset would otherwise read another tensor's bytes, or the header's, as weights)."""
        size = self.path.stat().st_size
        alignment = int(self.metadata.get("general.alignment", 32) or 32)
        previous = None
        for tensor in sorted(self._reader.tensors, key=lambda t: int(t.data_offset)):
            start = int(tensor.data_offset)
            end = start + int(tensor.n_bytes)
            if end > size:
                raise ModelFormatError(
                    f"{self.path}: truncated GGUF file: tensor {tensor.name!r} ends at byte {end:,} "
                    f"but the file has {size:,} bytes"
                )
            if start % alignment:
                raise ModelFormatError(f"{self.path}: damaged GGUF file: tensor {tensor.name!r} starts at byte "
                                       f"{start:,}, off the file's {alignment}-byte alignment")
            if previous is not None and start < previous[1]:
                raise ModelFormatError(f"{self.path}: damaged GGUF file: tensors {previous[0]!r} and {tensor.name!r} "
                                       "overlap")
            previous = (tensor.name, end)

    def _config(self) -> ModelConfig:
        arch, meta = self.architecture, self.metadata
        names = {tensor.name for tensor in self._reader.tensors}

        def get(key: str, default=None):
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ModelFormatError(f"{self.path}: metadata {arch}.{key} is missing")
            return value

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        head_dim = int(get("attention.key_length", hidden // heads))
        self._refuse_partial_rotary(head_dim)
        experts = int(meta.get(f"{arch}.expert_count") or 0)
        moe = {}
        if experts:
            sparse = {int(m.group(1)) for t in names if (m := _LAYER_NAME.fullmatch(t)) and m.group(2) == "ffn_gate_inp.weight"}
            moe = dict(num_experts=experts, num_experts_per_tok=int(get("expert_used_count")),
                       moe_intermediate_size=int(meta.get(f"{arch}.expert_feed_forward_length")
                                                 or get("feed_forward_length")),
                       shared_expert_intermediate_size=int(meta.get(f"{arch}.expert_shared_feed_forward_length") or 0),
                       norm_topk_prob=arch in ("llama", "qwen3moe"),  # (Mixtral, Qwen3-MoE renormalise; Qwen2-MoE not)
                       mlp_only_layers=tuple(i for i in range(int(get("block_count"))) if i not in sparse))
        return ModelConfig(
            model_type=self.model_type,
            vocab_size=int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length", 4096)),
            attention_bias="blk.0.attn_q.bias" in names,
            tie_word_embeddings="output.weight" not in names,
            rope_scaling=self._rope_scaling(names),
            qk_norm="blk.0.attn_q_norm.weight" in names,
            **moe,
            **(self._gemma3_fields(hidden, heads) if arch == "gemma3" else {}),
        )

    def _refuse_partial_rotary(self, head_dim: int) -> None:
        """llama.cpp's `rope.dimension_count` below the head size rotates part of each head (config.json's
        partial_rotary_factor), which `model/rope.py` does not: it would rotate all of it."""
        key = f"{self.architecture}.rope.dimension_count"
        rotated = self.metadata.get(key)
        if rotated is not None and int(rotated) != head_dim:
            raise ModelFormatError(f"{self.path}: metadata {key} {int(rotated)} is not the head size {head_dim} "
                                   "(RoPE over a part of each head is not implemented)")

    def _gemma3_fields(self, hidden: int, heads: int) -> dict:
        meta, layers = self.metadata, int(self.metadata["gemma3.block_count"])
        head_dim = int(meta.get("gemma3.attention.key_length") or hidden // heads)
        # llama.cpp: queries scaled by head_dim^-1/2, but hidden / heads for the 27B (62 layers)
        scalar = hidden // heads if layers == 62 else head_dim
        return dict(sandwich_norms=True, norm_weight_offset=GEMMA3_NORM_SHIFT, embedding_multiplier=hidden ** 0.5,
                    hidden_act="gelu_tanh", query_pre_attn_scalar=float(scalar),
                    sliding_window=int(meta.get("gemma3.attention.sliding_window") or 0),
                    layer_types=tuple("full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0
                                      else "sliding_attention" for i in range(layers)),
                    local_rope_theta=GEMMA3_LOCAL_ROPE_THETA)

    @property
    def model_type(self) -> str:
        """config.json's model type: the architecture, but Mixtral (llama with experts) and Qwen2-MoE."""
        if self.architecture == "llama" and self.metadata.get("llama.expert_count"):
            return "mixtral"
        return {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}.get(
            self.architecture, self.architecture)

    def _rope_scaling(self, names: set[str]) -> RopeScaling | None:
        """llama.cpp's RoPE scaling: `rope.scaling.*` metadata (linear, yarn), or a `rope_freqs` tensor
        of per-pair factors (Llama 3.1+'s, computed by the converter)."""
        arch, meta = self.architecture, self.metadata
        kind = meta.get(f"{arch}.rope.scaling.type")
        if "rope_freqs.weight" in names:
            if kind not in (None, "none"):
                raise ModelFormatError(f"{self.path}: both rope_freqs and RoPE scaling {kind!r}: which applies?")
            tensor = next(t for t in self._reader.tensors if t.name == "rope_freqs.weight")
            return RopeScaling("llama3", freq_factors=tuple(float(f) for f in np.asarray(tensor.data, np.float32)))
        if kind in (None, "none"):
            return None
        rope = {"rope_type": kind, "factor": meta.get(f"{arch}.rope.scaling.factor"),
                "original_max_position_embeddings": meta.get(f"{arch}.rope.scaling.original_context_length")}
        if meta.get(f"{arch}.rope.scaling.attn_factor") is not None:
            rope["attention_factor"] = meta[f"{arch}.rope.scaling.attn_factor"]
        return RopeScaling.from_hf(rope, int(meta.get(f"{arch}.context_length", 4096)), str(self.path))

    def _expert_tensors(self, tensor) -> Iterator[GGUFTensor]:
        """A mixture of experts' tensor as the checkpoint names it: the router, each expert of a stacked
        [E, out, in] tensor (its Q4_K groups split likewise), the shared expert and its gate."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        from draftwise.quant.q4k import q4k_to_groups

        layer, kind = _LAYER_NAME.fullmatch(tensor.name).groups()
        mixtral = self.model_type == "mixtral"
        block = f"model.layers.{layer}." + ("block_sparse_moe." if mixtral else "mlp.")
        names = {"gate": "w1", "up": "w3", "down": "w2"} if mixtral else {
            "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        shape = tuple(int(n) for n in reversed(tensor.shape))
        array = array.reshape(shape)
        if kind == "ffn_gate_inp.weight":
            yield GGUFTensor(block + "gate.weight", tensor.tensor_type.name, array, None)
        elif kind == "ffn_gate_inp_shexp.weight":
            yield GGUFTensor(block + "shared_expert_gate.weight", tensor.tensor_type.name, array.reshape(1, -1), None)
        elif kind in _SHARED_TENSORS:
            yield GGUFTensor(f"{block}shared_expert.{names[_SHARED_TENSORS[kind]]}.weight", tensor.tensor_type.name,
                             array, q4k_to_groups(tensor.data, *shape)
                             if tensor.tensor_type == GGMLQuantizationType.Q4_K else None)
        else:
            raw = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(shape[0], -1)  # [E, bytes of one]
            for e in range(shape[0]):
                groups = (q4k_to_groups(raw[e], *shape[1:]) if tensor.tensor_type == GGMLQuantizationType.Q4_K
                          else None)
                yield GGUFTensor(f"{block}experts.{e}.{names[_EXPERT_TENSORS[kind]]}.weight", tensor.tensor_type.name,
                                 array[e], groups)

    @property
    def num_tensors(self) -> int:
        return len(self._reader.tensors)

    def tensors(self) -> Iterator[GGUFTensor]:
        """Each tensor dequantized to float32, with its 4-bit groups where the file stores Q4_K."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        from draftwise.quant.q4k import q4k_factors, q4k_to_groups
        from draftwise.quant.q6k import q6k_values

        for tensor in self._reader.tensors:
            if tensor.name == "rope_freqs.weight":  # (read into the config: `_rope_scaling`)
                continue
            if _is_expert_tensor(tensor.name):
                yield from self._expert_tensors(tensor)
                continue
            name = hf_tensor_name(tensor.name, self.architecture)
            if name is None:
                raise ModelFormatError(f"{self.path}: unexpected tensor {tensor.name!r}")
            try:
                array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
            except NotImplementedError:
                raise ModelFormatError(
                    f"{self.path}: tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}"
                ) from None
            shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
            array = array.reshape(shape)
            if self.architecture == "gemma3" and name.endswith("norm.weight"):
                array = array - GEMMA3_NORM_SHIFT  # (as Hugging Face stores it; loading adds it back)
            groups, superblocks = None, None
            if tensor.tensor_type == GGMLQuantizationType.Q4_K and len(shape) == 2:
                groups = q4k_to_groups(tensor.data, *shape)
                superblocks = q4k_factors(tensor.data, *shape)
            elif tensor.tensor_type == GGMLQuantizationType.Q6_K and len(shape) == 2:
                superblocks = q6k_values(tensor.data, *shape)
            if self.architecture == "llama" and (".q_proj." in name or ".k_proj." in name):
                heads = self.config.num_attention_heads if ".q_proj." in name else self.config.num_key_value_heads
                array = unpermute_rotary(array, heads)
                if groups is not None:
                    groups = tuple(unpermute_rotary(part, heads) for part in groups)
                if superblocks is not None:
                    superblocks = {key: unpermute_rotary(part, heads) for key, part in superblocks.items()}
            yield GGUFTensor(name, tensor.tensor_type.name, array, groups, superblocks)
