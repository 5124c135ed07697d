"""One-time conversion of a GGUF file into a Hugging Face style folder in the cache.

The folder holds config.json, tokenizer.json, tokenizer_config.json and fp32 safetensors shards;
after the conversion, loading reads only safetensors (seconds instead of the minute GGUF parsing
and dequantization take). A `draftwise.json` marker written last makes a folder complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from draftwise.loading.gguf_file import GGUFFile
from draftwise.loading.gguf_tokenizer import build_tokenizer

CONVERTER_VERSION = 1
MARKER = "draftwise.json"
SHARD_BYTES = 1 << 30


def is_converted(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def convert_gguf(gguf_path: Path, folder: Path, progress: bool = True) -> Path:
    """Write `folder` from `gguf_path` (atomically: a partial folder is renamed at the end)."""
    gguf = GGUFFile(gguf_path)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)

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

    shard: dict[str, torch.Tensor] = {}
    shard_bytes, shard_index = 0, 0
    bar = tqdm(total=gguf.num_tensors, desc=f"converting {gguf_path.name}", unit="tensor", disable=not progress)
    for name, array in gguf.tensors():
        shard[name] = torch.from_numpy(array.copy())
        shard_bytes += array.nbytes
        bar.update()
        if shard_bytes >= SHARD_BYTES:
            save_file(shard, str(partial / f"model-{shard_index:05d}.safetensors"))
            shard, shard_bytes, shard_index = {}, 0, shard_index + 1
    if shard:
        save_file(shard, str(partial / f"model-{shard_index:05d}.safetensors"))
    bar.close()

    (partial / MARKER).write_text(json.dumps({
        "source": str(gguf_path), "converter_version": CONVERTER_VERSION,
        "architecture": gguf.architecture,
    }, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder
