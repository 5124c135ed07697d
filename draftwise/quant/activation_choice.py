"""Whether a quantized layer quantizes its activations to int8 (VNNI byte dot products) or keeps them
in bf16: chosen per weight kind (int4, int8) and layer shape by timing both native kernels on this
machine, once, and cached. An AVX2 build has only the int8-activation kernels: it always takes them.

Both kernels compute every row the same way whatever the number of rows, but not the same way as
each other, so one layer uses one of them for every pass (decoding, verification, prefill alike):
choosing per number of rows would make a token's logits depend on how many tokens share its pass,
and greedy speculation would no longer equal plain decoding. The measurement therefore covers the
passes that matter, one row (decoding, memory bound) and VERIFY_ROWS rows (verification, compute
bound), and int8 activations are taken where their total is lower.

The choice is cached per machine build (the kernels' source digest) under the draftwise cache,
written under a lock, so that every process on the machine (a benchmark's workers, a server's
replicas, whatever their thread counts) computes with the same kernel and produces the same tokens.

Both kernels are timed on one thread. On a machine shared with busy processes a run on two threads
waits at each of its barriers for a descheduled thread: every run then takes a scheduler time slice
(~7 ms, for kernels of 0.1-1 ms quiet; the int8 path's two parallel regions, quantization then the
product, twice that), so the timings said nothing and the choice, cached for good, came out bf16 (a
4-5x slower kernel there) for the 0.5B's 9728x896 layer in 4 of 4 such measurements and for the
1.5B's 2048x1536 int8 QKV in 2 of 4 (2026-11-28, Intel Xeon). One thread has no barrier: beside the
same two busy processes its timings were within 10% of quiet ones, and chose as quiet ones do.
The kernels give each thread whole strips of output channels, the same loop whatever the count, so
the one-thread ratio is the many-thread one (int4 9728x896: int8 at 0.27x / 0.18x of bf16 at 1 / 8
rows on one thread, 0.27x / 0.19x on two).

Measured on this project's AMD EPYC (2 threads; BENCHMARKS.md, the kernels issue): for int8 weights,
int8 activations took 0.71x the time of bf16 for the 151936x1536 LM head at 8 rows, 0.62x for
1536x8960, at a relative output error of 6.5e-3 against an exact product (bf16 activations: 1.6e-3).
For int4 weights (the Intel Xeon of 2026-11-24) 0.14-0.33x at 1 to 64 rows, error 5e-3.
DRAFTWISE_INT8_ACTIVATIONS=0 keeps bf16 (benchmarks compare both).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from functools import cache
from pathlib import Path

import torch

from draftwise.paths import cache_root
from draftwise.quant.native import has_bf16_kernels, kernels, source_digest

ACTIVATIONS_ENV = "DRAFTWISE_INT8_ACTIVATIONS"
ACTIVATION_BLOCK = 32  # the kernels quantize activations in groups of this many inputs
NATIVE_K_MULTIPLE = 64  # the bf16 kernels take input features in pairs of groups
VERIFY_ROWS = 8
ROUNDS = 9  # timed runs of each kernel, the two alternating


def int8_activations(kind: str, out_features: int, in_features: int) -> bool:
    """Whether a layer of this weight kind ("int4", "int8") and shape computes with int8 activations
    on this machine."""
    if os.environ.get(ACTIVATIONS_ENV, "1") == "0" or kernels() is None or in_features % ACTIVATION_BLOCK:
        return False
    if not has_bf16_kernels() or in_features % NATIVE_K_MULTIPLE:  # (the only native kernels for the shape)
        return True
    return _choice(kind, out_features, in_features)


@cache
def _choice(kind: str, out_features: int, in_features: int) -> bool:
    key = f"{kind} {out_features}x{in_features}"
    path = choices_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be measuring the same shape
        choices = _read(path)
        if key not in choices:
            choices[key] = measure(kind, out_features, in_features)
            temporary = path.with_suffix(".tmp")
            temporary.write_text(json.dumps(choices, indent=1, sort_keys=True))
            temporary.replace(path)
    return bool(choices[key]["int8"])


def choices_path() -> Path:
    return cache_root() / "kernels" / f"int8-activations-{source_digest()}.json"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def measure(kind: str, out_features: int, in_features: int) -> dict:
    """Both kernels on random weights of this kind and shape at 1 and VERIFY_ROWS rows, on one
    thread: the fastest of ROUNDS runs each (ms), and the choice."""
    from draftwise.quant.linear import STRIP, pack_for_native, pack_int8_strips, pack_strips

    native = kernels()
    generator = torch.Generator().manual_seed(0)
    if kind == "int8":
        weight = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
        scales = torch.rand(out_features, generator=generator) * 1e-2
        with_bf16 = lambda x: native.int8_matmul(x.to(torch.bfloat16), weight, scales)  # noqa: E731
        strips, padded_scales = pack_int8_strips(weight), torch.nn.functional.pad(scales, (0, -out_features % STRIP))
        with_int8 = lambda x: native.int8_matmul_q8(x, strips, padded_scales, out_features)  # noqa: E731
    else:
        quants = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=generator)
        scales = torch.rand(out_features, in_features // 32, generator=generator) * 1e-2
        nibbles, scale_min = pack_for_native(quants, scales, scales)
        strips = pack_strips(quants, scales, scales)
        with_bf16 = lambda x: native.int4_matmul(x.to(torch.bfloat16), nibbles, scale_min, out_features)  # noqa: E731
        with_int8 = lambda x: native.int4_matmul_q8(x, strips, out_features)  # noqa: E731
    timings = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (see the module's docstring: timings on more threads mean nothing on a busy machine)
    try:
        for rows in (1, VERIFY_ROWS):
            x = torch.randn(rows, in_features, generator=generator)
            timings[f"bf16 {rows}"], timings[f"int8 {rows}"] = fastest_alternating(lambda: with_bf16(x),
                                                                                   lambda: with_int8(x))
    finally:
        torch.set_num_threads(threads)
    int8_total = sum(t for name, t in timings.items() if name.startswith("int8"))
    bf16_total = sum(t for name, t in timings.items() if name.startswith("bf16"))
    return {"int8": int8_total < bf16_total, **{name: round(t * 1e3, 4) for name, t in timings.items()}}


def fastest_alternating(first, second, clock=time.perf_counter) -> tuple[float, float]:
    """The fastest of ROUNDS runs of each, the two taking turns (which goes first alternating), after
    one untimed run each: a burst of load during part of the measurement (a benchmark's worker
    starting beside it) slows both alike, where timing one kernel's runs all before the other's let
    the burst decide a choice that is cached for every later process."""
    first(), second()
    best = [float("inf"), float("inf")]
    runs = (first, second)
    for round_index in range(ROUNDS):
        for which in ((0, 1) if round_index % 2 == 0 else (1, 0)):
            start = clock()
            runs[which]()
            best[which] = min(best[which], clock() - start)
    return best[0], best[1]
