"""The decoder layer's small operations as native CPU calls (kernels/layer_ops.cpp): RMSNorm,
rotary embedding, SiLU-gated product, one call each instead of ~30 dispatched tensor operations per
layer. Compiled on first use like the other native kernels (for AVX-512, else AVX2); where that cannot
be had (neither, no compiler, DRAFTWISE_NATIVE_KERNELS=0), `layer_ops()` is None and the layers run op by op. Both
paths are batch-invariant; they round differently from each other, so a process uses one of them
for every pass.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from draftwise import native

SOURCE = Path(__file__).resolve().parent / "kernels" / "layer_ops.cpp"
BUILDS = (  # one source: its SiLU has a 16-lane and an 8-lane form
    native.Build("avx512", (SOURCE,), ("-O3", "-fopenmp", "-mavx512f", "-mfma", "-ffp-contract=off"), ("avx512f", "fma")),
    native.Build("avx2", (SOURCE,), ("-O3", "-fopenmp", "-mavx2", "-mfma", "-ffp-contract=off"), ("avx2", "fma")),
)


def source_digest() -> str:
    """Names the build this machine uses (cost profiles measured with one are not another's)."""
    return native.chosen_digest(BUILDS)


@cache
def layer_ops():
    """The compiled extension (rms_norm, apply_rotary, silu_mul), or None where it cannot be had."""
    return native.build("layer_ops", BUILDS)


def usable(x: torch.Tensor) -> bool:
    """Whether the native op takes this tensor: a float32 CPU tensor outside a compiled graph."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and not torch.compiler.is_compiling()
            and layer_ops() is not None)
