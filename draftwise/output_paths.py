"""Where a long command writes its results, checked before the work begins (a run that fails only
at its end, after minutes of measuring, loses what it measured)."""

from __future__ import annotations

import os
from pathlib import Path

from draftwise.errors import InvalidParameterError


def output_folder(path: str | Path, flag: str) -> Path:
    """`path` as a folder that exists (made if needed) and can be written to."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise InvalidParameterError(f"{flag} {folder}: exists and is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InvalidParameterError(f"{flag} {folder}: cannot be made ({error.strerror})") from None
    if not os.access(folder, os.W_OK):
        raise InvalidParameterError(f"{flag} {folder}: not writable")
    return folder


def output_file(path: str | Path, flag: str) -> Path:
    """`path` as a file that can be written (it may exist; its folder must)."""
    file = Path(path)
    if file.is_dir():
        raise InvalidParameterError(f"{flag} {file}: is a folder, not a file")
    folder = file.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK) or (file.exists() and not os.access(file, os.W_OK)):
        raise InvalidParameterError(f"{flag} {file}: cannot be written")
    return file
