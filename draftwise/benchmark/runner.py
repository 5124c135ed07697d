"""The one runner behind every suite of `draftwise bench`: contestants, each in its own process, run
the same items interleaved.

Words. A *config* is a named way of running (plain decoding, a drafter at some k, a weight format).
A *recipe* says how to build one or more of them and pickles (`configs.DraftwiseRecipe`,
`peers.HFRecipe`). A *contestant* is a built config: a `name`, a `reference` (the config whose
outputs its own must equal), `warm_up(prompt)` and `run(item)`. An *item* is either a prompt,
`(category, prompt)`, answered with a `RequestResult`, or a probe (`probes.py`): a picklable object
whose `measure(config)` runs inside the contestant (a closed loop at one concurrency, forward passes
over n tokens, teacher-forced quality) and returns a dict.

Interleaved: item by item, every contestant runs the item in turn, the first one rotating by one
per item (item i starts with contestant i mod n). This machine's speed drifts by 10-15% over tens of
minutes; run config after config, the drift falls on one config more than another (adaptive run 5
in BENCHMARKS.md); interleaved, it falls on all of them alike, and each config still sees the items
in the same order (an adaptive controller learns from them).

Build order. LLMs built one after another in one process ran 2-5% apart although identical (adaptive
run 6's control and the baseline-bias check in BENCHMARKS.md: once the first built was slowest, once
fastest; weight alignment was ruled out, the cause is unknown). So each recipe is built in a process
of its own (`isolation="process"`, the default; `workers.py`): multiprocessing with the spawn
context, one worker per recipe, built one at a time (a cost model measured while building has the
machine to itself); then the parent sends one item at a time and waits for its result, so exactly one
process computes at any moment. No LLM is built after another one in its process, so no build order
is left to bias it, and this holds within every single run. Rotating the build order instead would
need as many runs as configs to average the bias out, and each run would still carry it. A worker
costs its start-up (importing torch, building its LLM), and per item a pipe round trip and a 20 ms
pause (`workers.SETTLE_SECONDS`: one worker's spinning OpenMP threads never overlap the next item),
neither of them timed; nothing while it computes. `isolation="in-process"` builds every recipe here, in order: quick, for the tests and
for debugging, with the bias. Either way every table carries the plain-vs-plain control
(`configs.CONTROL`, built last): plain decoding again, run exactly like plain, whose ratio is the
run's noise floor.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from draftwise.errors import InvalidParameterError

ISOLATIONS = ("process", "in-process")
Prompt = tuple[str, str]  # (category, prompt text)


@dataclass(slots=True)
class RequestResult:
    category: str
    tokens: int
    seconds: float  # arrival to last token, prefill included
    ttft: float  # NaN: not measured (peers)
    token_ids: list[int]
    steps: int  # target decoding steps (drafts + plain steps); tokens - 1 for plain decoding; 0: unknown (peers)
    spec: dict | None = None  # the request's SpecMetrics as a dict (None: nothing speculated)
    prompt_tokens: int = 0  # 0: not known (peers)


@dataclass(slots=True)
class ConfigResult:
    name: str
    reference: str | None = "plain"  # whose outputs this config's must equal (a peer's: the peer's plain
    # decoding; None: not compared)
    requests: list[RequestResult] = field(default_factory=list)  # one per prompt item, in item order
    measures: list[dict] = field(default_factory=list)  # one per probe item, in item order


class BenchmarkInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run, carrying what finished: every contestant's results of the items before
    the one interrupted (so that the configs' results still pair item by item)."""

    def __init__(self, results: list[ConfigResult], done: int, total: int) -> None:
        super().__init__(f"interrupted after {done} of {total} items")
        self.results, self.done, self.total = results, done, total


class Contestant(Protocol):
    name: str
    reference: str

    def warm_up(self, prompt: str) -> None: ...

    def run(self, item: Any) -> Any: ...


class Recipe(Protocol):
    def build(self) -> list[Contestant]: ...


@contextmanager
def lineup(recipes: list[Recipe], isolation: str = "process") -> Iterator[list[Contestant]]:
    """Every recipe built (each in a worker process of its own, or here), in order; the workers end
    when the block does."""
    if isolation not in ISOLATIONS:
        raise InvalidParameterError(f"isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
    if isolation == "in-process":
        yield [contestant for recipe in recipes for contestant in recipe.build()]
        return
    from draftwise.benchmark.workers import Worker

    workers: list[Worker] = []
    try:
        for recipe in recipes:
            workers.append(Worker(recipe))  # returns once built: one build at a time
        yield [contestant for worker in workers for contestant in worker.contestants]
    finally:
        for worker in workers:
            worker.close()


def run_benchmark(contestants: list[Contestant], items: list, warm_up: str | None = None,
                  progress: bool = True, load=None) -> list[ConfigResult]:
    """Every contestant over every item, interleaved (the module docstring); one `ConfigResult` per
    contestant, in their order. Each contestant first warms up on `warm_up` (default: the first
    item's prompt; none if neither is given). `load`: a `background_load.BackgroundLoad`, started
    between items when the run reaches its start and stopped at the end."""
    from tqdm import tqdm

    if warm_up is None and items and isinstance(items[0], tuple):
        warm_up = items[0][1]
    if warm_up is not None:
        for contestant in contestants:
            contestant.warm_up(warm_up)
    results = [ConfigResult(c.name, c.reference) for c in contestants]
    bar = tqdm(total=len(items) * len(contestants), disable=not progress, leave=False, unit="run")
    index = 0
    try:
        for index, item in enumerate(items):
            if load is not None:
                load.before_item(index, len(items))
            for turn in range(len(contestants)):
                which = (index + turn) % len(contestants)
                bar.set_postfix_str(contestants[which].name)
                answer = contestants[which].run(item)
                (results[which].requests if isinstance(item, tuple) else results[which].measures).append(answer)
                bar.update()
    except KeyboardInterrupt:
        bar.close()
        prompts = sum(isinstance(item, tuple) for item in items[:index])
        for result in results:  # (the interrupted item's answers dropped: not every contestant ran it)
            del result.requests[prompts:], result.measures[index - prompts:]
        raise BenchmarkInterrupted(results, index, len(items)) from None
    finally:
        if load is not None:
            load.stop()
    bar.close()
    return results
