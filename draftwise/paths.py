"""Where draftwise keeps assembled and converted models (override with DRAFTWISE_CACHE)."""

from __future__ import annotations

import os
from pathlib import Path

from draftwise.errors import CacheNotWritableError

CACHE_ENV = "DRAFTWISE_CACHE"


def cache_root() -> Path:
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "draftwise").expanduser()
    if root.exists() and not root.is_dir():
        raise CacheNotWritableError(f"the cache {root} is a file, not a folder: set {CACHE_ENV} to a folder")
    return root
