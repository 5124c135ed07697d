"""Replace a model's linear layers by weight-only quantized ones.

Policy for `int4`, per linear layer (fused q/k/v and gate/up count as one):
  - every part stored as Q4_K in the GGUF file -> int4 from the file's own 4-bit groups (exact; with
    the Q4_K kernel, in the file's own super-blocks);
  - every part stored as Q6_K, where this machine has the Q6_K kernel -> Q6_K as the file holds it
    (exact, 6.5625 bits a weight; `q6k_linear.py`);
  - any other part stored with more bits (Q5_0, Q6_K, Q8_0, ...) -> int8 per channel, keeping that precision;
  - float checkpoints (F32/F16/BF16, HF folders) -> int4 quantized here (group 32, asymmetric).
`int4_all` (llama.cpp calls the like "pure"): every part in int4, the Q4_K ones from the file and the
wider ones quantized here; faster (about 0.55x the step time of `int4` for the 0.5B, whose GGUF is
mostly Q5_0/Q8_0) and a little less accurate. It is what `auto` picks for a draft model, whose
accuracy only moves the acceptance rate, never the output.
`int8` puts every linear layer in int8 per channel. The token embedding: int4 from the file where it is
stored as Q4_K (exact, a sixth of the float table's memory), int4 quantized here under `int4_all`,
float otherwise (`quant/embedding.py`).
On CUDA the same policy takes PyTorch's kernels (`cuda_linear.py`): no Q6_K there (wider parts are
int8), int8 too for a shape PyTorch's int4 kernel does not take, and the embedding stays float.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from draftwise.errors import InvalidParameterError
from draftwise.model.config import ModelConfig
from draftwise.quant.cuda_linear import CudaInt4Linear, CudaInt8Linear, int4_fits
from draftwise.quant.embedding import Int4Embedding
from draftwise.quant.linear import Int4Linear, Int8Linear, quantize_int4_groups
from draftwise.quant.q6k_linear import Q6KLinear, q6k_kernel_available

QUANTIZATIONS = ("auto", "int4", "int4_all", "int8", "none")
_FLOAT_TYPES = {None, "F32", "F16", "BF16", "F64"}
EMBEDDING_WEIGHT = "embed_tokens.weight"


@dataclass(slots=True)
class QuantizationReport:
    mode: str
    int4_from_file: list[str] = field(default_factory=list)  # layers using the GGUF's own Q4_K groups
    int4_quantized: list[str] = field(default_factory=list)  # layers quantized to int4 here
    int8: list[str] = field(default_factory=list)
    q6k_from_file: list[str] = field(default_factory=list)  # layers computing with the GGUF's own Q6_K blocks
    embedding: str = "float"  # "float", "int4 from the file's Q4_K" or "int4 quantized here"

    def summary(self) -> str:
        return (f"{self.mode}: {len(self.int4_from_file)} layers int4 from the file's Q4_K, "
                f"{len(self.q6k_from_file)} Q6_K from the file, "
                f"{len(self.int4_quantized)} int4 quantized here, {len(self.int8)} int8; embedding {self.embedding}")


def check_quantization(mode: str) -> str:
    if mode not in QUANTIZATIONS:
        raise InvalidParameterError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {mode!r}")
    return mode


def linear_sources(config: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """Our (possibly fused) linear layers: the checkpoint weights they are made of, with their rows."""
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    sources: dict[str, list[tuple[str, int]]] = {}
    for i in range(config.num_hidden_layers):
        attn, mlp = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        sources[f"{attn}.qkv_proj"] = [(f"{attn}.q_proj.weight", q_rows), (f"{attn}.k_proj.weight", kv_rows),
                                       (f"{attn}.v_proj.weight", kv_rows)]
        sources[f"{attn}.o_proj"] = [(f"{attn}.o_proj.weight", config.hidden_size)]
        if not config.is_sparse(i):
            sources.update(_swiglu_sources(mlp, config.intermediate_size, config.hidden_size))
            continue
        for e in range(config.num_experts):  # (the router and the shared expert's gate stay float: small)
            sources.update(_swiglu_sources(f"{mlp}.experts.{e}", config.moe_intermediate_size, config.hidden_size))
        if config.shared_expert_intermediate_size:
            sources.update(_swiglu_sources(f"{mlp}.shared_expert", config.shared_expert_intermediate_size,
                                           config.hidden_size))
    head = "embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    sources["lm_head"] = [(head, config.vocab_size)]
    return sources


def _swiglu_sources(path: str, width: int, hidden: int) -> dict[str, list[tuple[str, int]]]:
    return {f"{path}.gate_up_proj": [(f"{path}.gate_proj.weight", width), (f"{path}.up_proj.weight", width)],
            f"{path}.down_proj": [(f"{path}.down_proj.weight", hidden)]}


class StoredParts(Mapping):
    """A conversion's `<prefix>-*.safetensors` shards (keys `<name>.<part>`) as weight name ->
    `transform({part: tensor})`, each name read when asked for: read all at once, every layer's
    integers sat beside the float model until the last layer was quantized (~2.5 GB for the 1.5B)."""

    def __init__(self, folder: Path, prefix: str, transform=lambda parts: parts) -> None:
        self._where: dict[str, dict[str, tuple[Path, str]]] = {}  # name -> part -> (file, key)
        for file in sorted(folder.glob(f"{prefix}-*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    name, kind = key.removeprefix("model.").rsplit(".", 1)
                    self._where.setdefault(name, {})[kind] = (file, key)
        self._transform = transform

    def __getitem__(self, name: str):
        parts = {}
        for kind, (file, key) in self._where[name].items():
            with safe_open(str(file), framework="pt") as handle:
                parts[kind] = handle.get_tensor(key)
        return self._transform(parts)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _q4k_groups(part: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    packed = part["quants"]  # [N, K/2]: low nibble = even column, high nibble = odd column
    quants = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(packed.shape[0], -1)
    return quants, part["scales"], part["minimums"]


def read_q4k_groups(folder: Path) -> StoredParts:
    """The Q4_K groups a conversion kept: name -> (quants uint8 [N, K], scales, minimums [N, K/32])."""
    return StoredParts(folder, "q4k", _q4k_groups)


def read_superblocks(folder: Path) -> StoredParts:
    """The super-block integers a conversion kept (`convert.py`): name -> Q4_K's d, dmin, sub_scales,
    sub_mins or Q6_K's q, sub_scales, d."""
    return StoredParts(folder, "superblocks")


def _joined(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Fused parts' super-block tensors, rows after rows."""
    return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}


def stored_types(folder: Path) -> dict[str, str]:
    marker = folder / "draftwise.json"
    return json.loads(marker.read_text()).get("gguf_types", {}) if marker.is_file() else {}


def _int4_parts(weight: torch.Tensor, sources: list[tuple[str, int]], groups: dict) -> tuple[list, bool]:
    """(quants, scales, minimums) per part, from the file where it has Q4_K; whether all came from it."""
    parts, offset = [], 0
    for name, rows in sources:
        parts.append(groups[name] if name in groups else quantize_int4_groups(weight[offset:offset + rows]))
        offset += rows
    return parts, all(name in groups for name, _ in sources)


def _layer_kind(mode: str, names: list[str], shape: tuple[int, int], groups: Mapping, superblocks: Mapping,
                types: dict[str, str], cuda: bool = False) -> str:
    """How the policy above quantizes a linear layer of `shape` [N, K] made of these checkpoint
    weights: "q6k" (the file's Q6_K), "int8", or "int4" (the file's Q4_K groups where every part has
    them); `cuda`: for PyTorch's CUDA kernels."""
    wider = not all(name in groups or types.get(name) in _FLOAT_TYPES for name in names)
    q6k = all(types.get(name) == "Q6_K" and name in superblocks for name in names)
    if mode == "int4" and q6k and not cuda and q6k_kernel_available(shape[1]):
        return "q6k"
    if mode == "int8" or (mode == "int4" and wider) or (cuda and not int4_fits(*shape)):
        return "int8"
    return "int4"


def float_free_weights(model: nn.Module, mode: str, folder: Path, device: torch.device | str = "cpu") -> set[str]:
    """The checkpoint weights whose float values quantizing `model` (built, on any device) in `mode`
    for `device` never reads: every layer made of them (and the embedding, where it is one) comes
    from the file's own integers. A loader need not read them (the 1.5B's float copy is 6 GB; its
    Q4_K and Q6_K layers ~1 GB)."""
    if not mode.startswith("int4"):
        return set()
    cuda = torch.device(device).type == "cuda"
    groups, superblocks, types = read_q4k_groups(folder), read_superblocks(folder), stored_types(folder)
    covered, needed = set(), set()
    for path, sources in linear_sources(model.config).items():
        names = [name for name, _ in sources]
        layer = model.get_submodule(path)
        kind = _layer_kind(mode, names, (layer.out_features, layer.in_features), groups, superblocks, types, cuda)
        from_file = kind == "q6k" or (kind == "int4" and all(name in groups for name in names))
        (covered if from_file else needed).update(names)
    (covered if _embedding_from_file(mode, groups, cuda) else needed).add(EMBEDDING_WEIGHT)
    return covered - needed


def _embedding_from_file(mode: str, groups: Mapping, cuda: bool) -> bool:
    """Whether the token embedding becomes the file's own Q4_K groups (else float, or quantized here)."""
    return mode.startswith("int4") and EMBEDDING_WEIGHT in groups and not cuda


def quantize_model(model: nn.Module, mode: str, folder: Path | None) -> QuantizationReport:
    """Quantize `model`'s linear layers in place (mode "int4", "int4_all" or "int8")."""
    report = QuantizationReport(mode)
    groups = read_q4k_groups(folder) if mode.startswith("int4") and folder is not None else {}
    superblocks = read_superblocks(folder) if mode.startswith("int4") and folder is not None else {}
    types = stored_types(folder) if folder is not None else {}
    device = model.norm.weight.device
    cuda = device.type == "cuda"
    for path, sources in linear_sources(model.config).items():
        parent_path, _, attribute = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        linear: nn.Linear = getattr(parent, attribute)
        weight, bias = linear.weight.detach(), None if linear.bias is None else linear.bias.detach().clone()
        names = [name for name, _ in sources]
        kind = _layer_kind(mode, names, tuple(weight.shape), groups, superblocks, types, cuda)
        if kind == "q6k":
            joined = _joined([superblocks[name] for name in names])
            replacement = Q6KLinear(joined["q"], joined["sub_scales"], joined["d"], bias)
            report.q6k_from_file.append(path)
        elif kind == "int8":
            replacement = CudaInt8Linear(weight, bias) if cuda else Int8Linear(weight, bias)
            report.int8.append(path)
        else:
            parts, from_file = _int4_parts(weight, sources, groups)
            if cuda:  # (the file's groups are read to the CPU, groups quantized here are on the GPU)
                joined_parts = (torch.cat([part.to(device) for part in tensors]) for tensors in zip(*parts))
                replacement = CudaInt4Linear(*joined_parts, bias, device)
            else:
                q4k = from_file and all(types.get(name) == "Q4_K" and name in superblocks for name in names)
                factors = _joined([superblocks[name] for name in names]) if q4k else None
                replacement = Int4Linear(*(torch.cat(tensors) for tensors in zip(*parts)), bias, factors=factors)
            (report.int4_from_file if from_file else report.int4_quantized).append(path)
        setattr(parent, attribute, replacement)
    if not cuda:
        _quantize_embedding(model, mode, groups, types, report)
    return report


def quantized_layer(mode: str, weight: torch.Tensor) -> nn.Module:
    """A bias-free layer for the float weight [N, K] in the format `mode` gives layers quantized
    here (int4 for int4 modes, else int8), on its device's kernels."""
    cuda = weight.device.type == "cuda"
    if mode.startswith("int4") and (not cuda or int4_fits(*weight.shape)):
        groups = quantize_int4_groups(weight)
        return CudaInt4Linear(*groups, None, weight.device) if cuda else Int4Linear(*groups, None)
    return CudaInt8Linear(weight, None) if cuda else Int8Linear(weight, None)


def _quantize_embedding(model: nn.Module, mode: str, groups: dict, types: dict, report: QuantizationReport) -> None:
    """int4 modes keep a Q4_K embedding table as its own groups (exact); `int4_all` quantizes a table
    the file stores in another quantized type to int4 too; a float table stays float (so that a model
    drafting for itself looks up the same rows as itself as target)."""
    name = EMBEDDING_WEIGHT
    if _embedding_from_file(mode, groups, cuda=False):
        model.embed_tokens = Int4Embedding(*groups[name])
        report.embedding = "int4 from the file's Q4_K"
    elif mode == "int4_all" and types.get(name) not in _FLOAT_TYPES:
        model.embed_tokens = Int4Embedding(*quantize_int4_groups(model.embed_tokens.weight.detach()))
        report.embedding = "int4 quantized here"
