"""Which safetensors files of a Hugging Face folder hold its weights, and which tensors each holds.

With `model.safetensors.index.json`, exactly the files its `weight_map` names (as transformers and
vLLM read them), each holding exactly the tensors the map puts there: a stale shard left beside them is
not read. Without one, every weight file. Either way a tensor name in two files is refused: loading one
after the other would let one copy silently win.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from draftwise.errors import ModelFormatError

INDEX_NAME = "model.safetensors.index.json"
# Beside the weights and not weights: a conversion's integer groups and the packed-weight cache.
_NOT_WEIGHTS = ("q4k-", "superblocks-", "packed-")


def checkpoint_layout(folder: Path) -> dict[Path, list[str]]:
    """Each weight file with the tensor names it stores, checked against each other and the index."""
    index = _read_index(folder)
    files = _indexed_files(folder, index) if index is not None else _unindexed_files(folder)
    layout = {file: _tensor_names(file) for file in files}
    _refuse_duplicates(layout, folder)
    if index is not None:
        _check_against_index(layout, index, folder)
    return layout


def _read_index(folder: Path) -> dict[str, str] | None:
    """The index's weight_map (tensor name -> file name), or None where the folder has no index."""
    path = folder / INDEX_NAME
    if not path.exists():
        return None
    try:
        weight_map = json.loads(path.read_text()).get("weight_map")
    except (OSError, json.JSONDecodeError, AttributeError) as error:
        raise ModelFormatError(f"{path}: unreadable ({error})") from None
    if not isinstance(weight_map, dict) or not weight_map \
            or not all(isinstance(file, str) for file in weight_map.values()):
        raise ModelFormatError(f"{path}: no weight_map of tensor names to file names")
    return weight_map


def _indexed_files(folder: Path, index: dict[str, str]) -> list[Path]:
    files = [folder / name for name in sorted(set(index.values()))]
    for file in files:
        if not file.is_file():
            raise ModelFormatError(f"{folder / INDEX_NAME}: names weight file {file.name}, which is missing")
    return files


def _unindexed_files(folder: Path) -> list[Path]:
    files = sorted(f for f in folder.glob("*.safetensors") if not f.name.startswith(_NOT_WEIGHTS))
    if not files:
        raise ModelFormatError(f"{folder}: no *.safetensors weight files")
    return files


def _tensor_names(file: Path) -> list[str]:
    """The names in the file's header (the tensors themselves are read later, if at all)."""
    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except PermissionError:
        raise ModelFormatError(f"{file}: cannot be read (permission denied)") from None
    except (SafetensorError, OSError) as error:
        raise ModelFormatError(f"{file}: corrupt or truncated safetensors file ({error})") from None


def _refuse_duplicates(layout: dict[Path, list[str]], folder: Path) -> None:
    """The loader drops "model." from names, so "model.x" and "x" are one tensor too."""
    first_file: dict[str, Path] = {}
    for file, names in layout.items():
        for name in names:
            other = first_file.setdefault(name.removeprefix("model."), file)
            if other != file:
                raise ModelFormatError(f"{folder}: tensor {name!r} is in two weight files, {other.name} and "
                                       f"{file.name} (one copy would silently replace the other)")


def _check_against_index(layout: dict[Path, list[str]], index: dict[str, str], folder: Path) -> None:
    path = folder / INDEX_NAME
    for file, names in layout.items():
        for name in names:
            if name not in index:
                raise ModelFormatError(f"{path}: tensor {name!r} in {file.name} is not in the weight_map")
            if folder / index[name] != file:
                raise ModelFormatError(f"{path}: the weight_map puts tensor {name!r} in {index[name]}, "
                                       f"but {file.name} holds it")
    stored = {name for names in layout.values() for name in names}
    absent = sorted(set(index) - stored)
    if absent:
        raise ModelFormatError(f"{path}: the weight_map puts tensor {absent[0]!r} in {index[absent[0]]}, which "
                               f"does not hold it" + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""))
