"""Measure a `CostModel` on the machine at hand, and cache it per configuration.

The target is timed over n = 1..8, 12, 16, 24, 32, 48 and 64 new tokens after a 256-token context
(the larger n stand for batches: B rows verifying k + 1 tokens each); the drafter is
timed through its own `propose` (whatever it is: a model, a lookup, the target's first layers)
for k = 1..K on the same context, rolled back after each call exactly as after a rejected
draft. Each point is the fastest of a few round-robin repetitions after a warm-up. It takes a few seconds for
the default pair on a 2-core CPU, once: the result is cached under the draftwise cache folder,
keyed by the models, quantization, device, dtype, thread count, PyTorch version and low-bit kernel build.
"""

from __future__ import annotations

import hashlib
import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftwise.errors import InvalidParameterError
from draftwise.model import native_decoder, native_layer_ops
from draftwise.paths import cache_root
from draftwise.quant.activation_choice import ACTIVATIONS_ENV
from draftwise.quant.native import kernels as native_kernels
from draftwise.quant.native import source_digest
from draftwise.speculative.control.cost_model import CostModel
from draftwise.runner.model_runner import ModelRunner
from draftwise.sampling.params import SamplingParams
from draftwise.speculative.proposer import Proposer
from draftwise.text.tokenizer import Tokenizer

MEASURE_ATTEMPTS = 3
MAX_SPREAD = 1.25  # a profile whose repeats sit further apart than this was measured on a busy machine
MONOTONE_SLACK = 0.85  # a pass over more tokens may measure this much below one over fewer (noise), no lower
TARGET_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)  # 16+: batches of rows
CONTEXT_TOKENS = 256
MIN_CONTEXT_TOKENS = 2  # the shortest context the passes are timed after
REPEATS = 5
_SAMPLE_TEXT = (
    "def moving_average(values, window):\n"
    "    \"\"\"Return the mean of each run of `window` consecutive values.\"\"\"\n"
    "    if window <= 0:\n        raise ValueError('window must be positive')\n"
    "    total = sum(values[:window])\n    result = [total / window]\n"
    "    for i in range(window, len(values)):\n"
    "        total += values[i] - values[i - window]\n        result.append(total / window)\n"
    "    return result\n\n"
    "The function keeps a running total, so each step costs the same however wide the window is. "
)


logger = logging.getLogger(__name__)

PROFILES_ENV = "DRAFTWISE_PROFILES"  # where cost models are cached (default: <cache>/profiles)


def profile_path(key: str) -> Path:
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    folder = os.environ.get(PROFILES_ENV) or cache_root() / "profiles"
    return Path(folder) / f"{digest}.json"


def configuration_key(*parts: object) -> str:
    kernels = f"native-{source_digest()}" if native_kernels() is not None else "aten"
    if native_layer_ops.layer_ops() is not None:
        kernels += f", layer ops {native_layer_ops.source_digest()}"
        if native_decoder.wanted() and native_decoder.decoder_module() is not None:
            kernels += f", native layers {native_decoder.source_digest()}"
    if os.environ.get(ACTIVATIONS_ENV) == "0":
        kernels += ", bf16 activations"
    return " | ".join(str(part) for part in (*parts, f"threads={torch.get_num_threads()}",
                                             f"torch={torch.__version__}", f"low-bit kernels={kernels}"))


def load_or_measure(key: str, runner: ModelRunner, proposer: Proposer | None, tokenizer: Tokenizer,
                    max_draft_tokens: int, refresh: bool = False, measure_with=None) -> CostModel:
    """The cached cost model for `key`, measuring (and caching) it if absent, contaminated or if
    asked to, with `measure_with` (a drafter's own profiler) or `measure`. A measurement that comes
    out contaminated is taken again (MEASURE_ATTEMPTS in all); if every one is, the steadiest is
    used for this run and nothing is cached."""
    path = profile_path(key)
    cached = None if refresh else CostModel.read(path)
    if (cached is not None and cached.key == key and max(cached.target, default=0) >= max(TARGET_SIZES)
            and (proposer is None or max(cached.draft, default=0) >= max_draft_tokens)
            and contamination(cached) is None):
        return cached
    attempts = []
    for _ in range(MEASURE_ATTEMPTS):
        model = (measure_with or measure)(runner, proposer, tokenizer, max_draft_tokens)
        model.key = key
        why = contamination(model)
        if why is None:
            model.write(path)
            return model
        logger.warning("cost profile measured while the machine was busy (%s): measuring again", why)
        attempts.append(model)
    logger.warning("every cost profile came out contaminated: using the steadiest for this run, caching none")
    return min(attempts, key=lambda m: m.spread)


def contamination(model: CostModel) -> str | None:
    """Why a measured profile cannot be trusted (None: it can): repeats of one point far apart (the
    machine was busy while it was timed), or a pass over more tokens measured cheaper than one over
    fewer (impossible on a quiet machine: the same weights are read, more work is done)."""
    if model.spread > MAX_SPREAD:
        return f"repeats of one point {model.spread:.2f}x apart"
    points = sorted(model.target)
    for i, n in enumerate(points):
        for m in points[i + 1:]:
            if model.target[m] < MONOTONE_SLACK * model.target[n]:
                return f"{m} tokens measured at {model.target[m] * 1e3:.1f} ms, below {n} tokens' " \
                       f"{model.target[n] * 1e3:.1f} ms"
    return None


def measure(runner: ModelRunner, proposer: Proposer | None, tokenizer: Tokenizer,
            max_draft_tokens: int) -> CostModel:
    """Time the target over n new tokens and the drafter over k proposed tokens (needs a free row)."""
    capacity = min(runner.max_len, runner.blocks.num_blocks * runner.blocks.block_size)
    room = capacity - max(TARGET_SIZES) - max_draft_tokens - 2  # (the context the passes are timed after)
    if room < MIN_CONTEXT_TOKENS:
        raise InvalidParameterError(
            f"measuring this machine's speculation costs needs a context of {capacity - room + MIN_CONTEXT_TOKENS} "
            f"tokens, and the KV cache (or max_model_len) holds {capacity}: give the LLM more (kv_cache_memory_bytes, "
            f"max_model_len), or speculate with a fixed k (adaptive: false), which measures nothing")
    prompt_ids = _context_ids(tokenizer, min(CONTEXT_TOKENS, room))
    seq = ProfilingSequence(prompt_ids, max(TARGET_SIZES) + max_draft_tokens + 1)
    seq.row = runner.allocate()
    try:
        runner.forward([seq.row], [prompt_ids[:-1]], [1])  # the cache holds all but the newest token
        base = runner.length(seq.row)
        filler = prompt_ids[-1]

        def target_pass(n: int) -> None:
            runner.forward([seq.row], [[filler] * n], [n])
            runner.synchronize()  # (a GPU's pass is timed where it runs, not where it was queued)
            runner.truncate(seq.row, base)

        target, spread = _fastest_seconds({n: (lambda n=n: target_pass(n)) for n in TARGET_SIZES})
        draft: dict[int, list[float]] = {}
        catch_up = 0.0
        if proposer is not None:
            proposer.propose([seq], [1])  # warm-up; a drafter with its own cache catches up here
            proposer.on_verified([seq], [0])
            for _ in range(REPEATS):
                for k in range(1, max_draft_tokens + 1):
                    start = time.perf_counter()
                    drafted = len(proposer.propose([seq], [k])[0].token_ids)
                    elapsed = time.perf_counter() - start
                    proposer.on_verified([seq], [0])
                    if drafted:
                        draft.setdefault(drafted, []).append(elapsed)
            catch_up = _catch_up_per_token(proposer, seq, min(draft.get(1, [0.0])))
        return CostModel(target, {k: min(times) for k, times in draft.items()}, catch_up, spread=spread)
    finally:
        runner.free(seq.row)
        seq.row = None


@dataclass(slots=True)
class ProfilingSequence:
    """A greedy request that never grows: what a drafter is timed on (a `SequenceState`)."""

    prompt_ids: list[int]
    num_tokens_left: int
    request_id: str = "cost-profile"
    row: int | None = None
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0, max_tokens=None))
    segment: None = None
    tenant: None = None
    prefix_salt: bytes = b""
    finish_reason: None = None
    output_ids: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids


def _catch_up_per_token(proposer: Proposer, seq: ProfilingSequence, warm_seconds: float) -> float:
    """Time a first draft from scratch (the drafter's state released) against a warm one."""
    proposer.release(seq)
    backlog = proposer.lag(seq)
    start = time.perf_counter()
    proposer.propose([seq], [1])
    fresh_seconds = time.perf_counter() - start
    proposer.release(seq)
    return max(0.0, fresh_seconds - warm_seconds) / (backlog - 1) if backlog > 1 else 0.0


def _context_ids(tokenizer: Tokenizer, count: int) -> list[int]:
    ids = tokenizer.encode(_SAMPLE_TEXT)
    return (ids * (count // len(ids) + 1))[:max(count, 2)]


def _fastest_seconds(runs: dict, repeats: int = REPEATS) -> tuple[dict, float]:
    """The fastest of `repeats` timings of each run, taken round-robin after a warm-up so that a
    disturbance on a busy machine hits one repetition of many points, not every repetition of one;
    and the spread: over the points, the median of (median / fastest) of each point's repeats
    (about 1.0 on a quiet machine; a busy one stretches most repeats)."""
    for run in runs.values():
        run()
    times: dict = {key: [] for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - start)
    spread = statistics.median(statistics.median(values) / min(values) for values in times.values())
    return {key: min(values) for key, values in times.items()}, spread
