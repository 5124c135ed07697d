"""Probes: measurements run inside a draftwise config (`configs.DraftwiseConfig`), interleaved like
prompts. Each is a picklable dataclass whose `measure(config)` returns a dict."""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClosedLoop:
    """`concurrency` requests in flight through continuous batching until every prompt has run
    (`draftwise.llm.closed_loop`), greedy, each request labelled with its segment. The same prompts
    ran before (one by one, or in an earlier loop), so first its drafters forget earlier requests'
    text (suffix decoding would draft them as requests seen before) and the prefix cache is reset
    (the target would skip their prefill, a draft model could not: both serve them as new traffic)."""
    concurrency: int
    prompts: tuple[str, ...]
    segments: tuple[str, ...]
    max_tokens: int
    extras: tuple[dict, ...] = ()  # per prompt: SamplingParams fields beyond greedy (structured_outputs ...)

    def measure(self, config) -> dict:
        from draftwise.llm.closed_loop import run_closed_loop
        from draftwise.sampling.params import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=self.max_tokens, **extra) for extra in self.extras]
        config.llm.forget_drafter_history()
        config.llm.reset_prefix_cache()
        return run_closed_loop(config.llm, list(self.prompts), [self.max_tokens] * len(self.prompts),
                               self.concurrency, segments=list(self.segments), params=params or None)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The config's `LLM.engine_stats()` now (queues, KV blocks, prefix cache queries and hits)."""

    def measure(self, config) -> dict:
        return {k: v for k, v in config.llm.engine_stats().items() if k != "predicted_over_observed"}


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """The config's engine counters so far (decoding steps, drafting steps, structured outputs' time)."""

    def measure(self, config) -> dict:
        counters = config.llm.engine.counters
        return {"decode_steps": counters.decode_steps, "drafting_steps": counters.drafting_steps,
                "constrained_steps": counters.constrained_steps, "grammar_seconds": counters.grammar_seconds}


@dataclass(frozen=True, slots=True)
class ForwardCost:
    """Median seconds of one forward pass over n new tokens appended to a `context`-token row (warm
    cache, rolled back after each pass): what verifying k drafted tokens costs, n = k + 1. With
    `trees`, the same n tokens as a token tree too (a binary tree below the first, attended through
    the tree's paths), each tree pass right after its chain pass: what a tree of that size costs."""
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    context: int = 256
    repeats: int = 5
    trees: bool = False

    def measure(self, config) -> dict:
        runner = config.llm.runner
        vocab = config.llm.model.config.vocab_size
        row = runner.allocate()
        shapes = {"seconds": None, "tree_seconds": [-1]} if self.trees else {"seconds": None}
        try:
            runner.forward([row], [[(100 + i) % vocab for i in range(self.context)]], [1])
            measured: dict[str, dict[int, float]] = {name: {} for name in shapes}
            for n in self.sizes:
                samples: dict[str, list[float]] = {name: [] for name in shapes}
                for attempt in range(self.repeats + 1):
                    for name, tree in shapes.items():
                        parents = None if tree is None else [[-1] + [(s - 1) // 2 for s in range(1, n)]]
                        started = time.perf_counter()
                        runner.forward([row], [[7 + s % 3 for s in range(n)]], [n], parents=parents)
                        elapsed = time.perf_counter() - started
                        runner.truncate(row, self.context)
                        if attempt:  # the first is a warm-up
                            samples[name].append(elapsed)
                for name in shapes:
                    measured[name][n] = statistics.median(samples[name])
        finally:
            runner.free(row)
        return measured


@dataclass(frozen=True, slots=True)
class TeacherForced:
    """Quality on a fixed text: the first `num_tokens` of `text`, teacher-forced in windows of
    `window` tokens: perplexity, and each position's top-1 token (to compare formats)."""
    text: str
    num_tokens: int = 1536
    window: int = 512
    prompt: bool = False  # the windows computed as prompts are (`model/prompt_pass.py`: the config's prompt kernels)

    def measure(self, config) -> dict:
        import torch

        ids = config.llm.tokenizer.encode(self.text)[:self.num_tokens]
        model = config.llm.model
        rows = []
        with torch.inference_mode():
            for start in range(0, len(ids) - 1, self.window):
                window = ids[start:start + self.window + 1]
                hidden, _ = model.hidden_states(torch.tensor([window[:-1]]), torch.arange(len(window) - 1)[None],
                                                prompt=self.prompt)
                logits = model.logits(hidden)[0]
                rows.append(logits.float().log_softmax(-1))
        logprobs = torch.cat(rows)
        targets = torch.tensor(ids[1:])
        nll = -logprobs[torch.arange(len(targets)), targets].mean().item()
        return {"perplexity": math.exp(nll), "tokens": len(targets), "top1": logprobs.argmax(-1).tolist()}


@dataclass(frozen=True, slots=True)
class BuildInfo:
    """How the config was built: load seconds, its weights, its process, its drafter's cost model."""
    draft_sizes: tuple[int, ...] = (1, 3)

    def measure(self, config) -> dict:
        llm = config.llm
        costs = llm.cost_model
        return {"load_seconds": config.load_seconds, "pid": os.getpid(),
                "weights": llm.model.quantization.mode, "layers": llm.model.quantization.summary(),
                "draft_seconds": {k: costs.draft_seconds(k) for k in self.draft_sizes} if costs else None}


@dataclass(frozen=True, slots=True)
class ResidentMemory:
    """The config's process: resident memory now, and the bytes of its weights (the target's
    tensors, and what its drafters add: `Proposer.footprint`)."""

    def measure(self, config) -> dict:
        from draftwise.llm.host_memory import resident_bytes
        from draftwise.model.memory import module_bytes

        llm = config.llm
        drafters = sum(d.proposer.footprint().weights_bytes for d in llm.engine.drafters.values())
        return {"rss_bytes": resident_bytes(),
                "weights_bytes": module_bytes(llm.model) + drafters, "drafter_bytes": drafters}
