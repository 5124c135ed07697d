"""The native low-bit matmul kernels (kernels/lowbit_matmul.cpp: bf16 activations; kernels/q8_matmul.cpp:
int8 activations), compiled on first use (`draftwise/native.py`).

The kernels need AVX-512 with BF16 and VNNI dot products (every CPU with the first has the second)
and a C++ compiler. Where any of that is missing, `kernels()` returns None and the quantized layers
use PyTorch's packed kernels instead: same weights, a different (slower for several rows) path.
Set DRAFTWISE_NATIVE_KERNELS=0 to turn the native path off.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from draftwise import native

SOURCES = [Path(__file__).resolve().parent / "kernels" / name for name in ("lowbit_matmul.cpp", "q8_matmul.cpp")]
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "f16c", "fma")
COMPILE_FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma", "-mf16c"]


def unavailable_reason() -> str | None:
    """Why the native kernels cannot be used here, or None if they can be built."""
    return native.unavailable_reason(REQUIRED_CPU_FLAGS)


def source_digest() -> str:
    """Names a build and the weight layouts it reads (the packed-weight cache is keyed by it)."""
    return native.source_digest(SOURCES, COMPILE_FLAGS)


@cache
def kernels():
    """The compiled extension module (int4_matmul, int4_matmul_q8, int8_matmul, int8_matmul_q8), or None where it cannot be had."""
    return native.build("lowbit", SOURCES, COMPILE_FLAGS, REQUIRED_CPU_FLAGS)

