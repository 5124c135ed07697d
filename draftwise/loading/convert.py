"""One-time conversion of a GGUF file into a Hugging Face style folder in the cache.

The folder holds config.json, tokenizer.json, tokenizer_config.json and fp32 safetensors shards;
after the conversion, loading reads only safetensors (seconds instead of the minute GGUF parsing
and dequantization take). Tensors the file stores as Q4_K also keep their 4-bit groups
(`q4k-*.safetensors`: `<name>.quants` packed two per byte, `<name>.scales`, `<name>.minimums`), and
Q4_K and Q6_K tensors their super-block integers (`superblocks-*.safetensors`: Q4_K's `<name>.d`,
`.dmin`, `.sub_scales`, `.sub_mins`; Q6_K's `<name>.q`, `.sub_scales`, `.d`), so int4 inference uses
the file's own quantization. A `draftwise.json` marker written last makes a folder complete.
A config-only folder (`weights=False`) holds the same files but no weights: what a dummy load reads.
"""

from __future__ import annotations

import fcntl
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from draftwise.loading.gguf_file import GGUFFile
from draftwise.loading.gguf_tokenizer import build_tokenizer

CONVERTER_VERSION = 3
MARKER = "draftwise.json"
SHARD_BYTES = 1 << 30


class _ShardWriter:
    """Writes tensors into numbered safetensors files of about SHARD_BYTES each."""

    def __init__(self, folder: Path, prefix: str) -> None:
        self.folder, self.prefix = folder, prefix
        self.shard: dict[str, torch.Tensor] = {}
        self.bytes, self.index = 0, 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.shard[name] = tensor
        self.bytes += tensor.numel() * tensor.element_size()
        if self.bytes >= SHARD_BYTES:
            self.close()

    def close(self) -> None:
        if self.shard:
            save_file(self.shard, str(self.folder / f"{self.prefix}-{self.index:05d}.safetensors"))
            self.shard, self.bytes, self.index = {}, 0, self.index + 1


def is_converted(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def convert_gguf(gguf_path: Path, folder: Path, progress: bool = True, weights: bool = True) -> Path:
    """Write `folder` from `gguf_path` (atomically: a partial folder is renamed at the end). Processes
    converting the same file at once take turns (a lock beside the folder): the later ones find it done
    (two that wrote one partial folder together left a model without some of its files).
    weights=False: config and tokenizer only, from the file's metadata (no tensor dequantized)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(f".{folder.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_converted(folder):
            return folder
        return _convert(gguf_path, folder, progress, weights)


def _convert(gguf_path: Path, folder: Path, progress: bool, weights: bool = True) -> Path:
    gguf = GGUFFile(gguf_path)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    _write_config_and_tokenizer(gguf, gguf_path, partial)
    stored_types = _write_weights(gguf, gguf_path, partial, progress) if weights else {}
    (partial / MARKER).write_text(json.dumps({
        "source": str(gguf_path), "converter_version": CONVERTER_VERSION,
        "architecture": gguf.architecture, "gguf_types": stored_types, "weights": weights,
    }, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def _write_config_and_tokenizer(gguf: GGUFFile, gguf_path: Path, partial: Path) -> None:
    tokenizer = build_tokenizer(gguf.metadata, str(gguf_path))
    tokenizer.save(str(partial / "tokenizer.json"))
    meta = gguf.metadata
    tokens = meta["tokenizer.ggml.tokens"]

    def token_at(key: str) -> str | None:
        index = meta.get(key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    (partial / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": meta.get("tokenizer.chat_template"),
        "bos_token": token_at("tokenizer.ggml.bos_token_id"),
        "eos_token": token_at("tokenizer.ggml.eos_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    }, indent=2))
    (partial / "config.json").write_text(json.dumps(gguf.config.to_hf_dict(), indent=2))


def _write_weights(gguf: GGUFFile, gguf_path: Path, partial: Path, progress: bool) -> dict[str, str]:
    """Every tensor dequantized to fp32 shards (and Q4_K / Q6_K integers beside); how the file stored each."""
    weights = _ShardWriter(partial, "model")
    groups = _ShardWriter(partial, "q4k")
    superblocks = _ShardWriter(partial, "superblocks")
    bar = tqdm(total=gguf.num_tensors, desc=f"converting {gguf_path.name}", unit="tensor", disable=not progress)
    stored_types = {}
    for tensor in gguf.tensors():
        stored_types[tensor.name.removeprefix("model.")] = tensor.type_name
        weights.add(tensor.name, torch.from_numpy(tensor.weight.copy()))
        if tensor.q4k_groups is not None:
            quants, scales, minimums = tensor.q4k_groups
            packed = quants[:, 0::2] | (quants[:, 1::2] << 4)  # two 4-bit quants per byte
            groups.add(f"{tensor.name}.quants", torch.from_numpy(np.ascontiguousarray(packed)))
            groups.add(f"{tensor.name}.scales", torch.from_numpy(scales.copy()))
            groups.add(f"{tensor.name}.minimums", torch.from_numpy(minimums.copy()))
        for key, part in (tensor.superblocks or {}).items():
            superblocks.add(f"{tensor.name}.{key}", torch.from_numpy(np.ascontiguousarray(part)))
        bar.update()
    weights.close()
    groups.close()
    superblocks.close()
    bar.close()
    return stored_types
