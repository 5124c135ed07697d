"""Where draftwise keeps assembled and converted models (override with DRAFTWISE_CACHE)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "DRAFTWISE_CACHE"


def cache_root() -> Path:
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "draftwise"
    return Path(root).expanduser()
