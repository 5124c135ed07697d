"""Turn what a user names (a short name, a GGUF file, a Hugging Face folder) into a loadable folder."""

from __future__ import annotations

import hashlib
from pathlib import Path

from draftwise.errors import CacheNotWritableError, InvalidParameterError, ModelNotFoundError
from draftwise.paths import CACHE_ENV, cache_root
from draftwise.loading.convert import CONVERTER_VERSION, convert_gguf, is_converted
from draftwise.loading.fetch import assemble
from draftwise.loading.registry import KNOWN_MODELS


def known_model_file(name: str) -> Path:
    return cache_root() / "models" / f"{name}.gguf"


def resolve_model(model: str, progress: bool = True, load_format: str = "auto") -> Path:
    """Return a folder with config.json, tokenizer.json and safetensors for `model`; a cache that
    cannot be written where a model must be fetched or converted is a CacheNotWritableError.
    load_format "dummy" (random weights, `dummy.py`): a GGUF file's folder may hold no weights, for
    its tensors are not dequantized only to be replaced (its metadata are read, in a second or so)."""
    try:
        return _resolve(model, progress, load_format == "dummy")
    except OSError as error:
        if error.filename is None or not Path(error.filename).is_relative_to(cache_root()):
            raise
        raise CacheNotWritableError(
            f"the cache cannot be written ({error.strerror}: {error.filename}); set {CACHE_ENV} to a folder "
            "you may write (models are fetched and converted there)") from None


def _resolve(model: str, progress: bool, config_only: bool) -> Path:
    if model in KNOWN_MODELS:
        known = KNOWN_MODELS[model]
        gguf_path = known_model_file(model)
        if not gguf_path.is_file():
            assemble(known, gguf_path, progress=progress)
        return _converted(gguf_path, f"{model}-{known.sha256[:12]}", progress, config_only)

    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path}: a folder without config.json is not a Hugging Face model folder")
        return path
    if path.is_file():
        stat = path.stat()
        key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        return _converted(path, f"{path.stem}-{key}", progress, config_only)
    raise ModelNotFoundError(
        f"unknown model {model!r}: not a known name ({', '.join(KNOWN_MODELS)}) "
        "and no GGUF file or model folder at that path"
    )


def _converted(gguf_path: Path, name: str, progress: bool, config_only: bool) -> Path:
    """The GGUF file's converted folder in the cache, converted now if it is not there. config_only: a
    folder without weights will do (the full one too, where it exists: its config is the same)."""
    folder = cache_root() / "converted" / f"{name}-v{CONVERTER_VERSION}"
    if is_converted(folder):
        return folder
    if config_only:
        folder = folder.with_name(folder.name + "-config-only")
        return folder if is_converted(folder) else convert_gguf(gguf_path, folder, progress=progress, weights=False)
    return convert_gguf(gguf_path, folder, progress=progress)


def tokenizer_folder(tokenizer: str | None, model: str, model_folder: Path) -> Path:
    """The folder whose tokenizer an LLM reads (vLLM's `tokenizer`): the model's own (None, or the
    model's name again), or a Hugging Face tokenizer folder (`tokenizer.json`, with its
    `tokenizer_config.json` and chat template if it has them), or that `tokenizer.json` itself."""
    if tokenizer is None or tokenizer == model:
        return model_folder
    if not isinstance(tokenizer, (str, Path)):
        raise InvalidParameterError(f"tokenizer must be a folder's path, got {type(tokenizer).__name__}")
    path = Path(tokenizer).expanduser()
    if path.is_file() and path.name == "tokenizer.json":
        path = path.parent
    if not (path / "tokenizer.json").is_file():
        raise InvalidParameterError(f"tokenizer {str(tokenizer)!r}: no tokenizer.json there (give a Hugging Face "
                                    "tokenizer folder, or leave it out to use the model's own)")
    return path

