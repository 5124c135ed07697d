"""Whether an int8 layer quantizes its activations to int8 (VNNI byte dot products) or keeps them in
bf16: chosen per layer shape by timing both native kernels on this machine, once, and cached.

Both kernels compute every row the same way whatever the number of rows, but not the same way as
each other, so one layer uses one of them for every pass (decoding, verification, prefill alike):
choosing per number of rows would make a token's logits depend on how many tokens share its pass,
and greedy speculation would no longer equal plain decoding. The measurement therefore covers the
passes that matter, one row (decoding, memory bound) and VERIFY_ROWS rows (verification, compute
bound), and int8 activations are taken where their total is lower.

The choice is cached per machine build (the kernels' source digest and the thread count) under the
draftwise cache, written under a lock, so that every process on the machine (a benchmark's workers,
a server's replicas) computes with the same kernel and produces the same tokens.

Measured on this project's AMD EPYC (2 threads; BENCHMARKS.md, the kernels issue): int8 activations
took 0.71x the time of bf16 for the 151936x1536 LM head at 8 rows, 0.62x for 1536x8960, at a
relative output error of 6.5e-3 against an exact product (bf16 activations: 1.6e-3).
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
from draftwise.quant.native import kernels, source_digest

ACTIVATIONS_ENV = "DRAFTWISE_INT8_ACTIVATIONS"
ACTIVATION_BLOCK = 128  # the kernel quantizes activations in blocks of this many inputs
VERIFY_ROWS = 8
REPEATS = 3


def int8_activations(out_features: int, in_features: int) -> bool:
    """Whether an int8 layer of this shape computes with int8 activations on this machine."""
    if os.environ.get(ACTIVATIONS_ENV, "1") == "0" or kernels() is None or in_features % ACTIVATION_BLOCK:
        return False
    return _choice(out_features, in_features)


@cache
def _choice(out_features: int, in_features: int) -> bool:
    key = f"{out_features}x{in_features}"
    path = choices_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be measuring the same shape
        choices = _read(path)
        if key not in choices:
            choices[key] = measure(out_features, in_features)
            temporary = path.with_suffix(".tmp")
            temporary.write_text(json.dumps(choices, indent=1, sort_keys=True))
            temporary.replace(path)
    return bool(choices[key]["int8"])


def choices_path() -> Path:
    return cache_root() / "kernels" / f"int8-activations-{source_digest()}-threads{torch.get_num_threads()}.json"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def measure(out_features: int, in_features: int) -> dict:
    """Both kernels on random weights of this shape at 1 and VERIFY_ROWS rows: the fastest of a few
    runs each (ms), and the choice."""
    native = kernels()
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
    scales = torch.rand(out_features, generator=generator) * 1e-2
    timings = {}
    for rows in (1, VERIFY_ROWS):
        x = torch.randn(rows, in_features, generator=generator)
        timings[f"bf16 {rows}"] = _fastest(lambda: native.int8_matmul(x.to(torch.bfloat16), weight, scales))
        timings[f"int8 {rows}"] = _fastest(lambda: native.int8_matmul_q8(x, weight, scales))
    int8_total = sum(t for name, t in timings.items() if name.startswith("int8"))
    bf16_total = sum(t for name, t in timings.items() if name.startswith("bf16"))
    return {"int8": int8_total < bf16_total, **{name: round(t * 1e3, 4) for name, t in timings.items()}}


def _fastest(run) -> float:
    run()
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best
