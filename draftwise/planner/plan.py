"""The plan of `draftwise plan`: its options and results, the predictions and the recommendation.

The steps that produce it are in `make.py`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from draftwise.planner.replay import Replay
from draftwise.planner.simulate import Policy, Request, is_adaptive, simulate
from draftwise.errors import InvalidParameterError
from draftwise.speculative.config import MAX_SPECULATIVE_TOKENS
from draftwise.speculative.registry import all_specs, drafter_spec, option_value

PAYS_MARGIN = 1.02  # speculation "pays" when the best config is at least 2% above plain
TIE_MARGIN = PAYS_MARGIN  # configs predicted this close to the fastest are not told apart (`recommend`)


@dataclass(slots=True)
class PlanOptions:
    traffic: str
    model: str = "qwen2.5-coder-1.5b"
    # the drafters weighed: a registered name, or a name with options, "draft:model=smollm2-135m:
    # cross_tokenizer=true", so that two configs of one drafter are weighed side by side (each such
    # entry is the drafter's label in every table; empty: those benchmarked by default)
    drafters: tuple[str, ...] = ()
    drafter_options: dict[str, dict] = field(default_factory=dict)  # entry -> options (as SpeculativeConfig takes)
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    sample: int = 24
    max_tokens: int = 128
    max_k: int = 6
    segment_field: str | None = None
    price_per_mtok: float | None = None
    tokens_per_day: float | None = None
    seed: int = 0
    validate: bool = False
    validate_max_concurrency: int = 4
    validate_rounds: int = 3  # plain and each drafter, run this many times at each level (validate.py)
    # replicas (`fleet.py`): replica counts weighed (empty: none), each of this many threads (the
    # plan's runs use that count); a target load and latency picks the fewest that serve it
    replicas: tuple[int, ...] = ()
    threads_per_replica: int = 1
    target_qps: float | None = None
    slo_p95: float | None = None

    def __post_init__(self) -> None:
        self.drafters = tuple(self.drafters) or tuple(spec.name for spec in all_specs() if spec.benchmark_by_default)
        if len(set(self.drafters)) != len(self.drafters):
            raise InvalidParameterError(f"drafters are listed twice in {list(self.drafters)}")
        for entry in self.drafters:
            drafter_spec(drafter_method(entry)).parse_options(entry_options(entry))  # bad ones fail before any run
        if self.threads_per_replica != 1 and not self.replicas:
            raise InvalidParameterError("--threads-per-replica needs --replicas (the plan's runs use all threads "
                                        "otherwise)")
        if self.replicas and (min(self.replicas) < 1 or self.threads_per_replica < 1):
            raise InvalidParameterError("replica counts and threads per replica must be at least 1")
        if (self.target_qps is not None or self.slo_p95 is not None) and not self.replicas:
            raise InvalidParameterError("a target load or latency (--target-qps, --slo-p95) needs --replicas")
        if self.target_qps is not None and self.target_qps <= 0 or self.slo_p95 is not None and self.slo_p95 <= 0:
            raise InvalidParameterError("--target-qps and --slo-p95 must be positive")
        if not 1 <= self.max_k <= MAX_SPECULATIVE_TOKENS:
            raise InvalidParameterError(f"--max-k must be from 1 to {MAX_SPECULATIVE_TOKENS}, got {self.max_k}")
        if (self.price_per_mtok is None) != (self.tokens_per_day is None):
            raise InvalidParameterError("--price-per-mtok and --tokens-per-day go together (the cost table needs both)")
        if any(value is not None and not value > 0 for value in (self.price_per_mtok, self.tokens_per_day)):
            raise InvalidParameterError("--price-per-mtok and --tokens-per-day must be positive")
        if self.validate and not any(c <= self.validate_max_concurrency for c in self.concurrency):
            raise InvalidParameterError(f"--validate measures the levels up to --validate-max-concurrency "
                                        f"{self.validate_max_concurrency}, and none of {list(self.concurrency)} is")


@dataclass(slots=True)
class DrafterFacts:
    method: str  # the drafter's entry in `PlanOptions.drafters` (its name, or its name with options)
    acceptance: dict[str, dict]  # segment -> {"conditional": [...], "propose_rate": p}
    weights_bytes: int
    kv_bytes_per_token: int
    catch_up_window: int | None  # the most backlog a first draft absorbs (None: unbounded, or no cache)
    matches: list[list[int]] = field(default_factory=list)  # per sampled request: `Replay.matches`


@dataclass(slots=True)
class Plan:
    options: dict
    requests: int
    segments: dict[str, int]
    predictions: dict[str, list[dict]]  # config name -> one Prediction per concurrency
    best: dict[int, dict]  # concurrency -> {"config", "speedup", ...}
    switch_off_at: int | None
    drafters: list[DrafterFacts]
    memory: dict[str, dict]
    cost_per_day: dict[int, dict] | None
    calibration: float = 1.0  # real plain run / simulated plain run at concurrency 1
    validation: list[dict] = field(default_factory=list)
    sample_requests: list[dict] = field(default_factory=list)  # the sampled requests' lengths (`Request`s)
    step_overhead_seconds: float = 0.0  # what a real step costs beyond its timed target pass
    prefill: dict | None = None  # `measure.PrefillCost` fitted to every measuring run's prefills
    costs: dict[str, dict] = field(default_factory=dict)  # "plain" and each drafter -> the `CostModel` simulated
    fleet: dict | None = None  # `fleet.predict_fleet`'s, where replica counts were weighed


def drafter_method(entry: str) -> str:
    """"draft:model=x" -> "draft"."""
    return entry.split(":", 1)[0]


def entry_options(entry: str) -> dict:
    """"draft:model=x:draft_branches=2" -> {"model": "x", "draft_branches": 2} (numbers and true/false read
    as such, the rest as text)."""
    options = {}
    for pair in entry.split(":")[1:]:
        name, equals, text = pair.partition("=")
        if not name or not equals:
            raise InvalidParameterError(f"drafter {entry!r}: options go as name=value after its name, got {pair!r}")
        options[name] = option_value(text)
    return options


def speculative_dict(entry: str, options: PlanOptions) -> dict:
    """The speculative config (as `LLM.set_speculative` takes it) of a drafter the plan weighs: the
    options given for every drafter that takes them, then the entry's own."""
    return {"method": drafter_method(entry), **options.drafter_options.get(entry, {}), **entry_options(entry)}


def predict(plain_costs, costs_by_method: dict, acceptance_by_method: dict, windows: dict[str, int | None],
            requests: list[Request], options: PlanOptions,
            replays: dict[str, Replay] | None = None,
            prefill_seconds: Callable[[int], float] | None = None) -> dict[str, list[dict]]:
    """Every configuration at every concurrency, as JSON-ready dicts. A drafter with a replay of
    the sampled requests' drafts is simulated with it, others with their per-segment rates; prefills
    cost `prefill_seconds(n)` where given (timed here), else the cost models' pass over n."""
    table: dict[str, list[dict]] = {"plain": []}
    for c in options.concurrency:
        table["plain"].append(asdict(simulate(plain_costs, requests, {}, Policy(0), c, seed=options.seed,
                                              prefill_seconds=prefill_seconds)))
    for method, costs in costs_by_method.items():
        acceptance = acceptance_by_method[method]
        window = windows.get(method)
        policies = [Policy(options.max_k, adaptive=True)] + [Policy(k) for k in range(1, options.max_k + 1)]
        for policy in policies:
            name = f"{method} {policy.name}"
            table[name] = [asdict(simulate(costs, requests, acceptance, policy, c, catch_up_window=window,
                                           seed=options.seed, replay=(replays or {}).get(method),
                                           prefill_seconds=prefill_seconds))
                           for c in options.concurrency]
    return table


def recommend(predictions: dict[str, list[dict]], levels: tuple[int, ...],
              footprint: Callable[[str], tuple[int, int]] | None = None) -> tuple[dict[int, dict], int | None]:
    """The best config per level, and the level from which on speculation pays at none (None: it pays
    at the highest; a level where it does not pay below one where it does is no switch-off point).

    Configs predicted within `TIE_MARGIN` of the fastest are not told apart: the planner's speedups
    are validated to a few percent (BENCHMARKS.md, the planner sections), and a gain that small is no
    reason to hold a draft model's weights or to fix k for traffic the sample may not show. Among
    them the recommendation is the one that adds the least memory (`footprint(config)`: weights
    bytes, KV bytes per token), then an adaptive k before a fixed one, then the faster prediction.
    Each level's entry lists those ties (`tied`)."""
    footprint = footprint or (lambda config: (0, 0))
    best: dict[int, dict] = {}
    for i, c in enumerate(levels):
        plain = predictions["plain"][i]["tokens_per_second"]
        fastest = max(p[i]["tokens_per_second"] for p in predictions.values())
        tied = [name for name, p in predictions.items()
                if name != "plain" and p[i]["tokens_per_second"] * TIE_MARGIN >= fastest]
        if fastest / plain < PAYS_MARGIN or not tied:
            name, tied = "plain", []
        else:
            name = min(tied, key=lambda n: (footprint(n), not is_adaptive(n),
                                            -predictions[n][i]["tokens_per_second"]))
        point = predictions[name][i]
        best[c] = {"config": name, "speedup": point["tokens_per_second"] / plain,
                   "tokens_per_second": point["tokens_per_second"], "latency_p95": point["latency_p95"],
                   "plain_tokens_per_second": plain, "tied": sorted(tied)}
    switch_off = None
    for c in sorted(levels, reverse=True):  # (the lowest level with plain there and at every level above)
        if best[c]["config"] != "plain":
            break
        switch_off = c
    return best, switch_off


def drafter_footprint(memory_by_entry: dict[str, tuple[int, int]]) -> Callable[[str], tuple[int, int]]:
    """config name ("ENTRY adaptive k<=6", "ENTRY k=2") -> (weights bytes, KV bytes per token) its
    drafter adds, from each drafter entry's memory."""
    def footprint(config: str) -> tuple[int, int]:
        entry = max((e for e in memory_by_entry if config.startswith(e + " ")), key=len, default=None)
        return memory_by_entry[entry] if entry is not None else (0, 0)
    return footprint


def cost_report(best: dict[int, dict], options: PlanOptions) -> dict[int, dict] | None:
    if options.price_per_mtok is None or options.tokens_per_day is None:
        return None
    plain = options.tokens_per_day / 1e6 * options.price_per_mtok
    return {c: {"plain_per_day": plain, "with_speculation_per_day": plain / b["speedup"], "config": b["config"]}
            for c, b in best.items()}


def segment_counts(requests: list[Request]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for request in requests:
        counts[request.segment] = counts.get(request.segment, 0) + 1
    return counts
