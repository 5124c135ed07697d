"""Heads on disk: a folder with `head.safetensors` (the trained tensors) and `config.json` (its kind
and what it was trained for). Trained heads go to the cache, one per kind and target, where a
drafter asked for no particular head looks (`default_folder`)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from draftwise.errors import InvalidParameterError, ModelFormatError
from draftwise.loading.registry import KNOWN_MODELS
from draftwise.paths import cache_root

WEIGHTS = "head.safetensors"
CONFIG = "config.json"
CHECKPOINT = "checkpoint.pt"  # a training run's state after its last finished epoch


def default_folder(kind: str, target: str) -> Path:
    """Where `draftwise train-head` puts the head of this kind for this target: a known model by its
    name; a model at a path by its folder's name and a digest of its absolute path (two models of
    one name are two targets; "." is the folder it names, wherever it is run from)."""
    if target in KNOWN_MODELS:
        return cache_root() / "heads" / kind / target
    where = Path(target).expanduser().resolve()
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", where.name or "model")
    return cache_root() / "heads" / kind / f"{name}-{hashlib.sha256(str(where).encode()).hexdigest()[:10]}"


def head_folder(kind: str, label: str, target: str, given: str | None) -> Path:
    """The folder a drafter reads its head from: `given`, else the one trained for this target; a
    missing one is an error naming what was looked for (and the command that makes one)."""
    folder = Path(given) if given else default_folder(kind, target)
    if folder.is_dir() and (given or (folder / CONFIG).is_file()):  # (a finished run writes its config)
        return folder
    if given:
        raise InvalidParameterError(f"no {label} head at {folder}")
    command = f"draftwise train-head --target {target} --kind {kind} --data PROMPTS.jsonl"
    if (folder / CHECKPOINT).is_file():
        raise InvalidParameterError(f"the {label} head for {target!r} was not finished: its training was "
                                    f"interrupted ({folder / CHECKPOINT}); the same command resumes it: {command}")
    raise InvalidParameterError(f"no {label} head trained for {target!r} (looked in {folder}); make one with: "
                                f"{command}")


def save_head(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.detach().contiguous() for name, tensor in tensors.items()}, str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json.dumps(config, indent=2))


def read_head(folder: Path, kind: str, hidden_size: int, vocab_size: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of the head in `folder`, checked to be of `kind` and made for a target of
    this hidden size and vocabulary."""
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise InvalidParameterError(f"{folder}: not a head folder ({CONFIG} and {WEIGHTS} expected)")
    try:
        config = json.loads((folder / CONFIG).read_text())
        tensors = load_file(str(folder / WEIGHTS))
    except (OSError, ValueError, SafetensorError) as error:
        raise ModelFormatError(f"{folder}: unreadable head ({error})") from None
    if not isinstance(config, dict) or config.get("kind") != kind:
        found = config.get("kind") if isinstance(config, dict) else None
        raise InvalidParameterError(f"{folder}: a {found!r} head, not a {kind!r} one")
    if config.get("hidden_size") != hidden_size or config.get("vocab_size") != vocab_size:
        raise InvalidParameterError(
            f"{folder}: trained for hidden size {config.get('hidden_size')} and {config.get('vocab_size')} tokens "
            f"(target {config.get('target')!r}); this target has {hidden_size} and {vocab_size}")
    return config, tensors
