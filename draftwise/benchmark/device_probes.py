"""Measurements of one device, for `--suite gpu`: a forward pass's time at R rows x n tokens, the
memory bandwidth that bounds plain decoding, a whole-model step of a reference script. Every timing
waits for the device (`synchronize`), so a GPU's queued work is counted where it runs."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from draftwise.runner.model_runner import ModelRunner


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_seconds(runners: dict[str, ModelRunner], rows: int, tokens: int, context: int,
                    repeats: int) -> dict[str, float]:
    """Median seconds of one pass of `rows` rows x `tokens` new tokens after `context` cached tokens
    each (rolled back after every pass), per runner; the runners take turns, pass after pass, so a
    slow minute of the machine falls on all of them."""
    handles = {}
    for name, runner in runners.items():
        handles[name] = [runner.allocate() for _ in range(rows)]
        for handle in handles[name]:  # one row at a time: a long prefill of many rows may not fit a pass
            ids = [(11 + 7 * i) % min(1000, runner.vocab_size - 5) + 5 for i in range(context)]
            runner.forward([handle], [ids], [1])
    samples: dict[str, list[float]] = {name: [] for name in runners}
    try:
        for attempt in range(repeats + 2):  # two warm-ups: the first captures or compiles
            for name, runner in runners.items():
                runner.synchronize()
                started = time.perf_counter()
                runner.forward(handles[name], [[7] * tokens] * rows, [tokens] * rows)
                runner.synchronize()
                if attempt >= 2:
                    samples[name].append(time.perf_counter() - started)
                for handle in handles[name]:
                    runner.truncate(handle, context)
    finally:
        for name, runner in runners.items():
            for handle in handles[name]:
                runner.free(handle)
    return {name: statistics.median(values) for name, values in samples.items()}


def copy_bandwidth(device: torch.device, megabytes: int = 1024, repeats: int = 10) -> float:
    """Bytes per second moved by a large device-to-device copy (read + written), the best of
    `repeats`: the bandwidth that bounds a step reading every weight once."""
    source = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * source.numel() * source.element_size() / best


def reference_step(script: Path, config: Path, timeout: float = 600) -> dict | None:
    """Run a reference step script (`../shared/gpu/graph_step.py`: `python SCRIPT config.json`, its
    results written to $OUT/graph.json) and return them; None if it failed."""
    with tempfile.TemporaryDirectory() as out:
        result = subprocess.run([sys.executable, str(script), str(config)], capture_output=True, text=True,
                                env={**os.environ, "OUT": out}, timeout=timeout)
        path = Path(out) / "graph.json"
        if result.returncode != 0 or not path.exists():
            return {"error": (result.stderr or result.stdout)[-400:]}
        return json.loads(path.read_text())


def hf_step_seconds(folder: Path, device: torch.device, dtype: torch.dtype, levels: tuple[int, ...], context: int,
                    say: Callable, steps: int = 10) -> dict[int, float]:
    """Median seconds of one decoding step of Hugging Face transformers' eager forward (its own
    KV cache) at each number of rows in `levels`, after `context` tokens, the model built once on the
    device from `folder`'s config.json with random weights (only the shape matters for time); each
    level's figure goes through `say(label, seconds, True)` as it is measured."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with device:  # (random initialization where the model runs: seconds on a GPU, not a minute on its host)
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype).eval()
    seconds = {}
    for rows in levels:
        ids = torch.randint(5, min(1000, config.vocab_size), (rows, context), device=device)
        samples = []
        with torch.inference_mode():
            cache = model(ids, use_cache=True).past_key_values
            token = ids[:, -1:]
            for step in range(steps + 2):
                synchronize(device)
                started = time.perf_counter()
                cache = model(token, past_key_values=cache, use_cache=True).past_key_values
                synchronize(device)
                if step >= 2:
                    samples.append(time.perf_counter() - started)
        del cache
        seconds[rows] = say(f"HF eager step, {rows} rows", statistics.median(samples), True)
    del model
    return seconds
