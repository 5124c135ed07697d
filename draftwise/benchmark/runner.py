"""`draftwise bench`: plain decoding and speculative configs over the same prompts, in one run.

A config is written `plain`, `METHOD` (adaptive, k <= 8), `METHOD:k=K` (fixed k) or
`METHOD:k<=K` (adaptive, k <= K); METHOD is a registered drafter. Each config gets its own
LLM (its own drafter, cost model and controller memory) and a warm-up request (the first prompt,
4 tokens: builds the drafter and its cost model); then every prompt runs once, batch 1, greedy
unless a temperature is given, with the run's seed. Peers (`peers.py`) run beside them the same way.

Interleaved: prompt by prompt, each prompt runs under every config in turn, the first config
rotating by one per prompt. This machine's speed drifts by 10-15% over tens of minutes; run config
after config, the drift falls on one config more than another, and interleaving spreads it over all.

Per request: generated tokens, seconds (arrival to last token, prefill included), time to first
token, and the speculation counters. Per config and category the report gives tokens/s (tokens
over seconds), speedup over plain (the same ratio for plain), tau (Spec-Bench's mean accepted
tokens: tokens after the first per target decoding step), acceptance by position, TTFT p50 and
latency p50/p95, and how many outputs equal plain decoding's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from draftwise.errors import InvalidParameterError
from draftwise.sampling.params import SamplingParams
from draftwise.speculative.metrics import SpecMetrics
from draftwise.speculative.registry import all_specs, names
from draftwise.stats import percentile

CONFIG_PATTERN = re.compile(r"^(\w+)(?::k(=|<=)(\d+))?$")
DEFAULT_ADAPTIVE_K = 8


@dataclass(slots=True)
class RequestResult:
    category: str
    tokens: int
    seconds: float
    ttft: float
    token_ids: list[int]
    steps: int  # target decoding steps (drafts + plain steps); tokens - 1 for plain decoding; 0: unknown (peers)
    spec: dict | None = None


@dataclass(slots=True)
class ConfigResult:
    name: str
    reference: str = "plain"  # whose outputs this config's must equal (a peer's: the peer's plain decoding)
    requests: list[RequestResult] = field(default_factory=list)


def default_configs() -> list[str]:
    """The drafters benchmarked unless told otherwise, adaptive."""
    return [spec.name for spec in all_specs() if spec.benchmark_by_default]


def config_method(text: str) -> str:
    """The drafter a config names ('ngram:k=2' -> 'ngram'); unknown names and bad forms raise."""
    match = CONFIG_PATTERN.match(text)
    if not match or match.group(1) not in names():
        raise InvalidParameterError(f"config must be plain, METHOD, METHOD:k=K or METHOD:k<=K "
                                    f"(METHOD one of {', '.join(names())}), got {text!r}")
    return match.group(1)


def parse_config(text: str, options: dict[str, dict] | None = None) -> dict | None:
    """'plain' -> None; 'ngram:k=2' -> a speculative dict for `LLM.set_speculative`, with the
    method's `options[method]` added."""
    if text == "plain":
        return None
    method = config_method(text)
    _, relation, k = CONFIG_PATTERN.match(text).groups()
    spec: dict = {"method": method, "num_speculative_tokens": int(k) if k else DEFAULT_ADAPTIVE_K,
                  "adaptive": relation != "=", **(options or {}).get(method, {})}
    if spec["num_speculative_tokens"] < 1:
        raise InvalidParameterError(f"k must be at least 1 in {text!r}")
    return spec


@dataclass(slots=True)
class DraftwiseConfig:
    """One draftwise config on its own LLM: runs a prompt, returns what the report needs."""
    name: str
    llm: object  # draftwise.LLM
    params: SamplingParams
    reference: str = "plain"

    def warm_up(self, prompt: str) -> None:
        self.llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4))

    def run(self, category: str, prompt: str) -> RequestResult:
        output = self.llm.generate(prompt, self.params, segment=category)[0]
        metrics, spec = output.metrics, output.metrics.spec
        steps = (spec.num_drafts + spec.num_plain_steps) if spec else 0
        steps = steps or max(0, len(output.token_ids) - 1)  # plain decoding: one step per token after the first
        return RequestResult(category, len(output.token_ids), metrics.seconds, metrics.time_to_first_token or 0.0,
                             list(output.token_ids), steps, asdict(spec) if spec else None)


def draftwise_configs(make_llm: Callable[[], object], configs: list[str], params: SamplingParams,
                      options: dict[str, dict] | None = None) -> list[DraftwiseConfig]:
    """Plain first (the reference every output is compared with), then each config; `make_llm()`
    builds a fresh LLM on the target; `options`: method -> its drafter options."""
    specs = {name: parse_config(name, options) for name in ["plain"] + [c for c in configs if c != "plain"]}
    contestants = []
    for name, spec in specs.items():
        llm = make_llm()
        llm.set_speculative(spec, progress=False)
        contestants.append(DraftwiseConfig(name, llm, params))
    return contestants


def run_benchmark(contestants: list, prompts: list[tuple[str, str]], progress: bool = True) -> list[ConfigResult]:
    """Every contestant (`DraftwiseConfig`, or a peer with the same `name`, `reference`, `warm_up`
    and `run`) over every prompt, interleaved; one `ConfigResult` per contestant, in their order."""
    from tqdm import tqdm

    for contestant in contestants:
        contestant.warm_up(prompts[0][1])
    results = [ConfigResult(c.name, c.reference) for c in contestants]
    bar = tqdm(total=len(prompts) * len(contestants), disable=not progress, leave=False, unit="request")
    for index, (category, prompt) in enumerate(prompts):
        for turn in range(len(contestants)):
            which = (index + turn) % len(contestants)
            bar.set_postfix_str(contestants[which].name)
            results[which].requests.append(contestants[which].run(category, prompt))
            bar.update()
    bar.close()
    return results


def summarize(results: list[ConfigResult]) -> dict:
    """config -> category (and "all") -> figures. Speedups are over draftwise's plain decoding
    (results[0]); outputs are compared with each config's `reference`."""
    plain = results[0]
    by_name = {r.name: r for r in results}
    categories = list(dict.fromkeys(r.category for r in plain.requests)) + ["all"]
    summary: dict = {}
    for config in results:
        summary[config.name] = {}
        reference = by_name.get(config.reference, plain)
        for category in categories:
            mine = [r for r in config.requests if category in ("all", r.category)]
            base = [r for r in plain.requests if category in ("all", r.category)]
            same = [r for r in reference.requests if category in ("all", r.category)]
            summary[config.name][category] = _figures(mine, base, same)
    return summary


def _figures(mine: list[RequestResult], base: list[RequestResult], reference: list[RequestResult]) -> dict:
    speed = sum(r.tokens for r in mine) / max(1e-9, sum(r.seconds for r in mine))
    base_speed = sum(r.tokens for r in base) / max(1e-9, sum(r.seconds for r in base))
    steps = sum(r.steps for r in mine)
    merged = SpecMetrics()
    for r in mine:
        if r.spec:
            merged.merge(SpecMetrics(**r.spec))
    latencies = sorted(r.seconds for r in mine)
    ttfts = sorted(r.ttft for r in mine if r.ttft == r.ttft)  # NaN: not measured (peers)
    return {"requests": len(mine), "tokens": sum(r.tokens for r in mine), "tokens_per_s": speed,
            "speedup": speed / base_speed if base_speed else 0.0,
            "tau": sum(r.tokens - 1 for r in mine) / steps if steps else None,
            "acceptance_rate": merged.acceptance_rate if merged.num_drafts else None,  # None: nothing drafted
            "acceptance_by_position": merged.acceptance_rate_per_position,
            "ttft_p50": percentile(ttfts, 0.5) if ttfts else None, "latency_p50": percentile(latencies, 0.5),
            "latency_p95": percentile(latencies, 0.95),
            "equal_to_plain": sum(a.token_ids == b.token_ids for a, b in zip(mine, reference))}

