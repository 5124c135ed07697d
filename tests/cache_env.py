"""Environments for `draftwise` commands run as subprocesses with a cache of their own."""

from __future__ import annotations

import os
from pathlib import Path

from draftwise.paths import cache_root


def own_cache_env(cache: Path) -> dict[str, str]:
    """os.environ with DRAFTWISE_CACHE at `cache`, whose kernels folder is the session's: the native
    kernels (compiled by this test session already) are not compiled again (~80 s a command)."""
    cache.mkdir(parents=True, exist_ok=True)
    kernels = cache_root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    if not (cache / "kernels").exists():
        (cache / "kernels").symlink_to(kernels, target_is_directory=True)
    return {**os.environ, "DRAFTWISE_CACHE": str(cache)}
