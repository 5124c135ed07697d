"""Building draftwise's native CPU kernels: C++ sources compiled with PyTorch's extension builder on
first use (about a minute, once per machine, source and PyTorch version), kept in the cache.

Each kernel family says which CPU flags it needs; where a flag or the compiler is missing, or
DRAFTWISE_NATIVE_KERNELS=0, `build` returns None and its callers fall back to PyTorch's ops.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from functools import cache
from pathlib import Path

import torch

from draftwise.paths import cache_root

NATIVE_ENV = "DRAFTWISE_NATIVE_KERNELS"

log = logging.getLogger(__name__)


@cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def unavailable_reason(required_flags: tuple[str, ...]) -> str | None:
    """Why kernels needing these CPU flags cannot be used here, or None if they can be built."""
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return f"turned off by {NATIVE_ENV}=0"
    missing = [flag for flag in required_flags if flag not in cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (install g++)"
    return None


def source_digest(sources: list[Path], flags: list[str]) -> str:
    """Names a build: its sources and its compiler flags."""
    return hashlib.sha256(b"".join(source.read_bytes() for source in sources) + " ".join(flags).encode()).hexdigest()[:12]


def build(family: str, sources: list[Path], flags: list[str], required_flags: tuple[str, ...]):
    """The compiled extension module of `sources`, or None where it cannot be had (logged)."""
    reason = unavailable_reason(required_flags)
    if reason is not None:
        log.info("native %s kernels not used: %s", family, reason)
        return None
    from torch.utils import cpp_extension

    digest = source_digest(sources, flags)
    version = torch.__version__.replace("+", "-")
    folder = cache_root() / "kernels" / f"{family}-{digest}-torch{version}"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(name=f"draftwise_{family}_{digest}", sources=[str(source) for source in sources], extra_cflags=flags,
                                  extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
    except Exception as error:  # a failed build must not stop the engine: PyTorch's ops remain
        log.warning("native %s kernels failed to build, using PyTorch's: %s", family, str(error).splitlines()[0])
        return None
