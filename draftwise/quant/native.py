"""The native low-bit matmul kernels (kernels/lowbit_matmul.cpp), compiled on first use.

The kernels need AVX-512 with BF16 dot products and a C++ compiler; the build (about a minute,
once per machine and PyTorch version) lands in the draftwise cache and later loads take
milliseconds. Where any of that is missing, `kernels()` returns None and the quantized layers use
PyTorch's packed kernels instead: same weights, a different (slower for several rows) path.

Set DRAFTWISE_NATIVE_KERNELS=0 to turn the native path off.
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

SOURCE = Path(__file__).resolve().parent / "kernels" / "lowbit_matmul.cpp"
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "f16c", "fma")
COMPILE_FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-mf16c"]

log = logging.getLogger(__name__)


def unavailable_reason() -> str | None:
    """Why the native kernels cannot be used here, or None if they can be built."""
    if os.environ.get("DRAFTWISE_NATIVE_KERNELS", "1") == "0":
        return "turned off by DRAFTWISE_NATIVE_KERNELS=0"
    flags = _cpu_flags()
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in flags]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (install g++)"
    return None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def source_digest() -> str:
    """Names a build and the weight layouts it reads (the packed-weight cache is keyed by it)."""
    return hashlib.sha256(SOURCE.read_bytes() + " ".join(COMPILE_FLAGS).encode()).hexdigest()[:12]


@cache
def kernels():
    """The compiled extension module (int4_matmul, int8_matmul), or None where it cannot be had."""
    reason = unavailable_reason()
    if reason is not None:
        log.info("native low-bit kernels not used: %s", reason)
        return None
    from torch.utils import cpp_extension

    digest = source_digest()
    version = torch.__version__.replace("+", "-")
    build = cache_root() / "kernels" / f"lowbit-{digest}-torch{version}"
    build.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(name=f"draftwise_lowbit_{digest}", sources=[str(SOURCE)],
                                  extra_cflags=COMPILE_FLAGS, extra_ldflags=["-fopenmp"],
                                  build_directory=str(build), verbose=False)
    except Exception as error:  # a failed build must not stop the engine: PyTorch's kernels remain
        log.warning("native low-bit kernels failed to build, using PyTorch's: %s", str(error).splitlines()[0])
        return None


def set_enabled(enabled: bool) -> None:
    """Turn the native path on or off for layers built from now on (benchmarks compare both)."""
    os.environ["DRAFTWISE_NATIVE_KERNELS"] = "1" if enabled else "0"
    kernels.cache_clear()
