"""Load a Hugging Face style folder (config.json + *.safetensors) into a `Transformer`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from draftwise.errors import InvalidParameterError, ModelFormatError
from draftwise.loading.dummy import dummy_model
from draftwise.loading.weight_files import checkpoint_layout
from draftwise.model.config import ModelConfig
from draftwise.model.onednn_linear import pack_linear_layers
from draftwise.quant.apply import QuantizationReport, check_quantization, float_free_weights, quantize_model
from draftwise.quant.cuda_linear import int4_supported
from draftwise.quant.packed_cache import cache_path, load_packed, save_packed
from draftwise.model.transformer import Transformer
from draftwise.loading.shape_check import check_config_against_checkpoint
from draftwise.model.unallocated import unallocated_transformer


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    try:
        return ModelConfig.from_hf_dict(json.loads(path.read_text()), source=str(path))
    except (OSError, json.JSONDecodeError) as error:
        raise ModelFormatError(f"{path}: unreadable ({error})") from None


def _read_tensors(folder: Path, only: set[str] | None = None, unread: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by our names ("model." dropped); `only` these names if given; those
    `unread` as meta tensors of their shape (placeholders for layers built from other data)."""
    tensors: dict[str, torch.Tensor] = {}
    for file, keys in checkpoint_layout(folder).items():  # (its files and names checked before any read)
        if not _readable(file):
            raise ModelFormatError(f"{file}: cannot be read (permission denied)")
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in keys:
                    name = key.removeprefix("model.")
                    if name in unread:
                        tensors[name] = torch.empty(handle.get_slice(key).get_shape(), device="meta")
                    elif only is None or name in only:
                        tensors[name] = handle.get_tensor(key)
        except (SafetensorError, OSError) as error:
            raise ModelFormatError(f"{file}: corrupt or truncated safetensors file ({error})") from None
    return tensors


def _offset_norms(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Gemma's norms scale by (1 + w) where the checkpoint stores w: folded into the weight once here."""
    if config.norm_weight_offset:
        for name in tensors:
            if name.endswith("norm.weight"):
                tensors[name] = tensors[name].float() + config.norm_weight_offset
    return tensors


def _fused_state(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename Hugging Face tensors to ours, fusing q/k/v and gate/up into single matrices."""
    def take(name: str) -> torch.Tensor:
        try:
            return tensors.pop(name)
        except KeyError:
            raise ModelFormatError(f"weight {name!r} is missing from the checkpoint") from None

    state = {"embed_tokens.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")}
    lm_head = tensors.pop("lm_head.weight", None)
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = lm_head if lm_head is not None else take("lm_head.weight")
    for i in range(config.num_hidden_layers):
        src, dst = f"layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        norms = ("input_layernorm", "post_attention_layernorm") + (
            ("pre_feedforward_layernorm", "post_feedforward_layernorm") if config.sandwich_norms else ())
        for norm in norms + (("self_attn.q_norm", "self_attn.k_norm") if config.qk_norm else ()):
            state[f"{dst}{norm}.weight"] = take(f"{src}{norm}.weight")
        state[dst + "self_attn.qkv_proj.weight"] = torch.cat(
            [take(attn + "q_proj.weight"), take(attn + "k_proj.weight"), take(attn + "v_proj.weight")])
        if config.attention_bias:
            state[dst + "self_attn.qkv_proj.bias"] = torch.cat(
                [take(attn + "q_proj.bias"), take(attn + "k_proj.bias"), take(attn + "v_proj.bias")])
        state[dst + "self_attn.o_proj.weight"] = take(attn + "o_proj.weight")
        if config.is_sparse(i):
            state.update(_expert_state(take, src, dst, config))
        else:
            state.update(_swiglu_state(take, src + "mlp.", dst + "mlp.", "gate_proj", "up_proj", "down_proj"))
    leftover = [name for name in tensors if not name.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise ModelFormatError(f"unexpected weights in the checkpoint: {', '.join(leftover[:5])}")
    return state


def _checkpoint_name(name: str, config: ModelConfig) -> str:
    """Where one of our unfused tensors sits in the checkpoint (Mixtral keeps its router elsewhere)."""
    if config.model_type == "mixtral" and name.endswith(".mlp.gate.weight"):
        return name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
    return name


def _swiglu_state(take, src: str, dst: str, gate: str, up: str, down: str) -> dict[str, torch.Tensor]:
    return {dst + "gate_up_proj.weight": torch.cat([take(f"{src}{gate}.weight"), take(f"{src}{up}.weight")]),
            dst + "down_proj.weight": take(f"{src}{down}.weight")}


def _expert_state(take, src: str, dst: str, config: ModelConfig) -> dict[str, torch.Tensor]:
    """A mixture-of-experts block's weights: Mixtral's (`block_sparse_moe`, experts' w1 / w3 / w2) or
    Qwen2-MoE's (`mlp`, gate / up / down projections, a shared expert and its gate)."""
    if config.model_type == "mixtral":
        block, names = src + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        block, names = src + "mlp.", ("gate_proj", "up_proj", "down_proj")
    state = {dst + "mlp.gate.weight": take(block + "gate.weight")}
    for e in range(config.num_experts):
        state.update(_swiglu_state(take, f"{block}experts.{e}.", f"{dst}mlp.experts.{e}.", *names))
    if config.shared_expert_intermediate_size:
        state.update(_swiglu_state(take, block + "shared_expert.", dst + "mlp.shared_expert.", *names))
        state[dst + "mlp.shared_expert_gate.weight"] = take(block + "shared_expert_gate.weight")
    return state


def resolve_quantization(mode: str, device: torch.device | str, dtype: torch.dtype, *, draft: bool = False) -> str:
    """`auto`: int4 on CPU (this project's kernels), the float weights elsewhere.

    For a draft model `auto` means int4_all: its accuracy only moves the acceptance rate. On CUDA,
    int4 / int4_all / int8 are asked for by name and take PyTorch's kernels (`quant/cuda_linear.py`),
    with bfloat16 activations.
    """
    check_quantization(mode)
    kind = torch.device(device).type
    if mode == "auto":
        if kind != "cpu" or dtype != torch.float32:
            return "none"
        return "int4_all" if draft else "int4"
    if mode == "none":
        return mode
    if kind == "cuda":
        if dtype != torch.bfloat16:
            raise InvalidParameterError(f"quantization {mode!r} on CUDA needs dtype bfloat16 (PyTorch's int4 and "
                                        f"int8 kernels take bf16 activations), got {dtype}")
        if mode.startswith("int4"):
            why = int4_supported(torch.device(device))
            if why is not None:
                raise InvalidParameterError(f"quantization {mode!r}: {why}; use 'int8' or 'none'")
        return mode
    if kind != "cpu" or dtype != torch.float32:
        raise InvalidParameterError(f"quantization {mode!r} needs device cpu with dtype float32, or cuda with bfloat16")
    return mode


LOAD_FORMATS = ("auto", "dummy")


def load_model(folder: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               pack_cpu_weights: bool = True, quantization: str = "none", load_format: str = "auto") -> Transformer:
    """Build the model on `device` in `dtype`.

    quantization "int4"/"int8"/"auto" replaces linear layers by weight-only quantized ones (see
    draftwise.quant.apply); with "none", fp32 CPU weights are prepacked for oneDNN unless told not to.
    The report of what was quantized how is left on `model.quantization`. load_format "dummy": random
    weights of the config's shape (`dummy.py`), no weight files read.
    """
    if load_format not in LOAD_FORMATS:
        raise InvalidParameterError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    model = _build_model(folder, device, dtype, pack_cpu_weights, quantization, load_format)
    if torch.device(device).type == "cuda" and dtype == torch.float32:  # cuBLAS's sums change order with the rows
        from draftwise.model.triton_linear import use_invariant_linears  # (Triton only where there is a GPU: ~70 MB)

        use_invariant_linears(model)
    return model


def _build_model(folder: Path, device: torch.device | str, dtype: torch.dtype, pack_cpu_weights: bool,
                 quantization: str, load_format: str) -> Transformer:
    config = read_config(folder)
    mode = resolve_quantization(quantization, device, dtype)
    if load_format == "dummy":
        model = dummy_model(config, device, dtype).eval().requires_grad_(False)
        model.quantization = QuantizationReport("none")
        if mode != "none":
            model.quantization = quantize_model(model, mode, None)  # (the folder's stored groups are real weights)
            pack_linear_layers(model)  # (the float ones left: a mixture of experts' routers)
        elif pack_cpu_weights:
            pack_linear_layers(model)
        return model
    check_config_against_checkpoint(folder, config)  # (before anything of the config's size is built)
    on_cpu = torch.device(device).type == "cpu"  # (CUDA's layers pack on the device, quickly: not cached)
    if mode != "none" and on_cpu:
        cached = _load_packed_model(folder, config, mode)
        if cached is not None:
            return cached
    # Weights that quantizing takes whole from the file's integers are not read (meta placeholders
    # until their layers are replaced); the rest are, and each float layer is freed as it is quantized.
    model = unallocated_transformer(config)
    unread = float_free_weights(model, mode, folder, device) if mode != "none" else set()
    tensors = _offset_norms(_read_tensors(folder, unread=unread), config)  # (its errors name the folder)
    try:
        state = _fused_state(tensors, config)
    except ModelFormatError as error:
        raise ModelFormatError(f"{folder}: {error}") from None
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    for name, tensor in state.items():  # (tensor by tensor; the placeholders stay as they are)
        state[name] = tensor if tensor.is_meta else tensor.to(device=device, dtype=dtype)
    _load_state(model, state, folder)
    del state, tensors
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.eval().requires_grad_(False)
    model.quantization = QuantizationReport("none")
    if mode != "none":
        model.quantization = quantize_model(model, mode, folder)
        placeholders = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
        if placeholders:  # (a policy and its prediction of what it reads that disagree: a bug, said plainly)
            raise RuntimeError(f"{folder}: weights left unread that quantization did not replace: {placeholders[:5]}")
        if on_cpu:
            save_packed(model, model.quantization, cache_path(folder, mode))
        pack_linear_layers(model)  # (the float ones left, a mixture of experts' routers: row-independent)
    elif pack_cpu_weights:
        pack_linear_layers(model)
    return model


def _load_state(model: Transformer, state: dict[str, torch.Tensor], folder: Path) -> None:
    """The weights into the model built from config.json; a config that disagrees with them is named."""
    try:
        model.load_state_dict(state, assign=True, strict=True)
    except RuntimeError as error:  # (torch lists every mismatched tensor: the first few say enough)
        lines = [line.strip() for line in str(error).splitlines()[1:] if line.strip()]
        raise ModelFormatError(f"{folder}: config.json disagrees with the weights: {'; '.join(lines[:3])}"
                               + (f" (and {len(lines) - 3} more)" if len(lines) > 3 else "")) from None


def _load_packed_model(folder: Path, config: ModelConfig, mode: str) -> Transformer | None:
    """The model from its packed-weight cache (see draftwise.quant.packed_cache), or None."""
    path = cache_path(folder, mode)
    if not path.is_file():
        return None
    model = unallocated_transformer(config)
    report = load_packed(path, model)
    if report is None:
        return None
    wanted = set(model.state_dict())  # what is left once the linear layers came from the cache
    stored = {_checkpoint_name(name, config): name for name in wanted}
    tensors = {stored[name]: tensor.float() for name, tensor in
               _offset_norms(_read_tensors(folder, only=set(stored)), config).items()}
    if wanted - set(tensors):
        raise ModelFormatError(f"{folder}: weights missing from the checkpoint: {sorted(wanted - set(tensors))[:5]}")
    _load_state(model, tensors, folder)
    model.eval().requires_grad_(False)
    model.quantization = report
    pack_linear_layers(model)  # (the float ones left: a mixture of experts' routers)
    return model


def _readable(file: Path) -> bool:
    return os.access(file, os.R_OK)
