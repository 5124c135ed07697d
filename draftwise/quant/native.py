"""The native low-bit matmul kernels, compiled on first use (`draftwise/native.py`), one build per CPU:

- AVX-512 (with BF16 and VNNI dot products: Zen 4, Sapphire Rapids and later; every CPU with the
  first has the second): kernels/lowbit_matmul.cpp (bf16 activations: `int4_matmul`, `int8_matmul`)
  and kernels/q8_matmul.cpp (int8 activations: `int4_matmul_q8`, `int8_matmul_q8`);
- AVX2 (with FMA and F16C: Zen 2/3, Haswell and later): kernels/q8_matmul_avx2.cpp, the int8-
  activation kernels only (`int4_matmul_q8`, `int8_matmul_q8`), on the same packed weights.

On CPUs with AMX tiles (AMX-BF16) a third family, kernels/amx_prompt.cpp, computes prompts
(`q4k_matmul_amx`, `q6k_matmul_amx`, `int4_matmul_amx`, `int8_matmul_amx`: `model/prompt_pass.py`)
on the int8-activation kernels' strips.

Where neither fits or a compiler is missing, `kernels()` returns None and the quantized layers use
PyTorch's packed kernels instead: same weights, a different (slower) path. Set
DRAFTWISE_NATIVE_KERNELS=0 to turn the native path off.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from draftwise import native
from draftwise.model.prompt_pass import prompt_kernels_wanted

KERNELS = Path(__file__).resolve().parent / "kernels"
BUILDS = (
    native.Build("avx512", (KERNELS / "lowbit_matmul.cpp", KERNELS / "q8_matmul.cpp"),
                 ("-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma", "-mf16c"),
                 ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "f16c", "fma")),
    native.Build("avx2", (KERNELS / "q8_matmul_avx2.cpp",), ("-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"),
                 ("avx2", "f16c", "fma")),
)


AMX_BUILDS = (
    native.Build("amx", (KERNELS / "amx_prompt.cpp",),
                 ("-O3", "-fopenmp", "-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mf16c", "-mfma"),
                 ("amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512_bf16", "f16c", "fma")),
)


def unavailable_reason() -> str | None:
    """Why the native kernels cannot be used here, or None if they can be built."""
    return native.unavailable_reason(BUILDS)


def source_digest() -> str:
    """Names a build and the weight layouts it reads (the packed-weight cache is keyed by it)."""
    return native.chosen_digest(BUILDS)


@cache
def kernels():
    """The compiled extension module (int4_matmul_q8, int8_matmul_q8, and on AVX-512 int4_matmul and
    int8_matmul), or None where it cannot be had."""
    return native.build("lowbit", BUILDS)


def has_bf16_kernels() -> bool:
    """Whether this machine's build has the bf16-activation kernels (AVX-512 only)."""
    return kernels() is not None and hasattr(kernels(), "int4_matmul")


def prompt_kernels():
    """The prompt's kernels where prompts take them (`model/prompt_pass.py`): the AMX kernels, unless
    DRAFTWISE_PROMPT_KERNELS=0; else None."""
    return amx_kernels() if prompt_kernels_wanted() else None


def amx_tiles_here() -> bool:
    """Whether this CPU has the AMX tiles the prompt kernels take (from its flags: builds nothing)."""
    return native.chosen(AMX_BUILDS) is not None


@cache
def amx_kernels():
    """The prompt's AMX kernels (`q4k_matmul_amx`, `q6k_matmul_amx`, `int4_matmul_amx`, `int8_matmul_amx`:
    kernels/amx_prompt.cpp), or None where the CPU has no AMX-BF16, the kernels are off or Linux refuses
    this process the tiles."""
    module = native.build("amx_prompt", AMX_BUILDS)
    return module if module is not None and module.amx_usable() else None
