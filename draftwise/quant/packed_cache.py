"""Cache of a model's quantized linear layers, packed as the CPU kernels want them.

Quantizing and packing the 1.5B takes ~12 s (int8 rounding of its Q6_K layers, int4 repacking),
and reading its fp32 weights only to throw most of them away costs as much again. The first load
with a quantization mode writes the packed layers next to the converted weights; later loads read
them (about 1 GB for the 1.5B in int4) and take only the norms and the embedding from the fp32 files.

The packed int4 layout belongs to the kernel path (native or PyTorch's), the PyTorch build and the
CPU's kernel capability, so all three are part of the file name; a cache written elsewhere is simply
not found, and writing one removes those earlier native kernel builds left for the same mode. A
damaged cache file is ignored and rewritten. An int4 embedding table (`embedding.py`) is cached with
the layers. The cache records the weight files it was packed from (names, sizes, modification
times): a folder whose weights were replaced since (a fine-tune saved over it) is packed again,
never served the old layers.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from draftwise.quant.apply import QuantizationReport, linear_sources
from draftwise.quant.embedding import Int4Embedding
from draftwise.quant.linear import Int4Linear, Int8Linear
from draftwise.quant.native import kernels as native_kernels
from draftwise.quant.native import source_digest
from draftwise.quant.q6k_linear import Q6KLinear
from draftwise.quant.superblock_strips import SUPERBLOCKS_ENV

CACHE_FORMAT = 4
EMBEDDING = "embed_tokens"
LAYERS_PER_OPEN = 8  # linear layers read through one mapping of the file (see load_packed)


def cache_path(folder: Path, mode: str) -> Path:
    capability = torch.backends.cpu.get_cpu_capability().lower()
    version = torch.__version__.replace("+", "-")
    path = f"native{source_digest()}" if native_kernels() is not None else "aten"
    if os.environ.get(SUPERBLOCKS_ENV, "1") == "0":
        mode += "-strips"  # (Q4_K and Q6_K in the older layouts: a cache of their own)
    return folder / f"packed-{mode}-{path}-torch{version}-{capability}-f{CACHE_FORMAT}.safetensors"


def weights_fingerprint(folder: Path) -> str:
    """What the packed layers were made from: the folder's config and weight files (not the caches
    written beside them), by name, size and modification time."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("packed-")
                   and (p.suffix in (".safetensors", ".bin", ".pt", ".gguf") or p.name == "config.json"))
    stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.blake2b(json.dumps(stamp).encode(), digest_size=16).hexdigest()


def save_packed(model: nn.Module, report: QuantizationReport, path: Path) -> None:
    """Write every quantized linear layer of `model`; best effort (a read-only cache is fine)."""
    tensors: dict[str, torch.Tensor] = {}
    for name in linear_sources(model.config):
        layer = model.get_submodule(name)
        for key, tensor in layer.packed_state().items():
            tensors[f"{name}.{key}"] = tensor.contiguous()
        if layer.bias is not None:
            tensors[f"{name}.bias"] = layer.bias.contiguous()
    if isinstance(model.embed_tokens, Int4Embedding):
        for key, tensor in model.embed_tokens.packed_state().items():
            tensors[f"{EMBEDDING}.{key}"] = tensor.contiguous()
    metadata = {"report": json.dumps(asdict(report)), "format": str(CACHE_FORMAT),
                "weights": weights_fingerprint(path.parent)}
    partial = path.with_suffix(".partial")
    try:
        save_file(tensors, str(partial), metadata=metadata)
        partial.replace(path)
    except (OSError, SafetensorError):  # (safetensors reports a folder it may not write in its own error)
        partial.unlink(missing_ok=True)
        return
    _remove_stale(path)


def _remove_stale(path: Path) -> None:
    """Remove the caches earlier native kernel builds wrote for the same mode (and layouts) beside
    `path` (each is as large as the quantized weights, and no build reads another's)."""
    if "-native" not in path.name:
        return
    prefix = path.name[:path.name.index("-native")]  # packed-MODE or packed-MODE-strips
    for other in path.parent.glob(f"{prefix}-native*.safetensors"):
        if other.name != path.name:
            other.unlink(missing_ok=True)


def load_packed(path: Path, model: nn.Module) -> QuantizationReport | None:
    """Put the cached layers into `model` (built on the meta device); None if the cache is unusable.

    The file is opened afresh for every LAYERS_PER_OPEN layers: pages read through its mapping stay
    resident until it is closed, so one mapping for the whole load held the packed weights twice at
    its end (the 1.5B: ~1 GB more for a moment; the 0.5B draft model's install: ~0.45 GB)."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("format") != str(CACHE_FORMAT) or metadata.get("weights") != weights_fingerprint(path.parent):
                return None  # another format, or packed from weights since replaced
            report = QuantizationReport(**json.loads(metadata["report"]))
            keys = set(handle.keys())
        names = list(linear_sources(model.config))
        layers = {}
        for first in range(0, len(names), LAYERS_PER_OPEN):
            with safe_open(str(path), framework="pt") as handle:
                for name in names[first:first + LAYERS_PER_OPEN]:
                    # (fresh copies: the kernels need their own aligned memory, not views into the file)
                    state = {key.removeprefix(f"{name}."): handle.get_tensor(key).clone() for key in keys
                             if key.startswith(f"{name}.") and "." not in key.removeprefix(f"{name}.")}
                    bias = state.pop("bias", None)
                    kind = Int8Linear if name in report.int8 else Q6KLinear if name in report.q6k_from_file \
                        else Int4Linear
                    layers[name] = kind.from_packed(state, bias)
        with safe_open(str(path), framework="pt") as handle:
            embedding = {key.removeprefix(f"{EMBEDDING}."): handle.get_tensor(key).clone() for key in keys
                         if key.startswith(f"{EMBEDDING}.")}
        if embedding:
            layers[EMBEDDING] = Int4Embedding.from_packed(embedding)
    except (SafetensorError, OSError, KeyError, ValueError, TypeError):
        return None
    for name, layer in layers.items():
        parent_path, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, attribute, layer)
    return report
