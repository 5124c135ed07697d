"""Throughput and latency against concurrency: plain decoding vs adaptive speculation, batched.

    python bench/concurrency.py [--levels 1,2,4,8,16] [--requests 16] [--max-tokens 64]

Closed loop through the continuous-batching engine (`LLM.add_request` / `LLM.step`): at
concurrency c there are always c requests in flight (a finished one is replaced by the next
prompt at once) until `--requests` have finished. Prompts: Spec-Bench first turns (2 per
category, in the chat template) and HumanEval prompts, the same for every config and level, each
request carrying its category as its traffic segment. Level by level, every config in turn (the
first one rotating), each config with its own LLM, so the machine's drift falls on every config
alike. Greedy, default weights. Reported per config and level: total generated tokens per second over
the level's wall time, the speedup over plain decoding at the same level, per-request latency
(arrival to last token) p50 / p95, and whether every output equals plain decoding's. Writes
BENCHMARKS.md's `concurrency` section and a plot (bench/plots/concurrency.png).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.adaptive import workload  # noqa: E402
from bench.report import RESULTS, table, write_section  # noqa: E402
from draftwise import LLM, SamplingParams  # noqa: E402
from draftwise.planner.measure import run_closed_loop  # noqa: E402

PLOT = Path(__file__).resolve().parent / "plots" / "concurrency.png"
CONFIGS = {
    "plain": None,
    "draft adaptive": {"method": "draft", "num_speculative_tokens": 8},
    "ngram adaptive": {"method": "ngram", "num_speculative_tokens": 8},
}


def plot(results: dict, levels: list[int]) -> None:
    from draftwise.benchmark.plots import plot_against_concurrency

    series = {name: ([by_level[str(c)]["tokens_per_s"] for c in levels], [by_level[str(c)]["p95"] for c in levels])
              for name, by_level in results.items()}
    plot_against_concurrency(series, levels, PLOT, ("generated tokens / s", "p95 request latency, s"),
                             "Qwen2.5-Coder 1.5B (int4) on this CPU: continuous batching")


def report(results: dict, levels: list[int], args: argparse.Namespace) -> str:
    plain = results["plain"]
    rows = []
    for name, by_level in results.items():
        for c in levels:
            point = by_level[str(c)]
            base = plain[str(c)]
            equal = sum(a == b for a, b in zip(point["outputs"], base["outputs"]))
            rows.append([name, c, f"{point['tokens_per_s']:.1f}", f"{point['tokens_per_s'] / base['tokens_per_s']:.2f}x",
                         f"{point['p50']:.1f}", f"{point['p95']:.1f}", f"{equal}/{len(base['outputs'])}"])
    return (f"{args.requests} requests per level (Spec-Bench 2 per category + HumanEval), greedy, up to "
            f"{args.max_tokens} new tokens, default weights; c requests in flight at all times, each labelled with "
            "its category as its traffic segment. Level by level, the configs in turn (one LLM each).\n\n"
            + table(["config", "concurrency", "tokens/s", "vs plain", "p50 latency s", "p95 latency s",
                     "outputs = plain"], rows)
            + f"\n\n![throughput and p95 latency vs concurrency](bench/plots/{PLOT.name})\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default="1,2,4,8,16")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    levels = [int(c) for c in args.levels.split(",")]
    partial = RESULTS / "concurrency-partial.json"
    results: dict = json.loads(partial.read_text()) if args.report_only else {}
    if not args.report_only:
        names = args.configs.split(",")
        # one LLM per config (~1.6 GB each with the int4 target); an adaptive config measures its
        # cost model on construction (cached on disk)
        llms = {name: LLM("qwen2.5-coder-1.5b", speculative=CONFIGS[name], max_num_seqs=max(levels),
                          max_model_len=2048, progress=False) for name in names}
        items = workload(next(iter(llms.values())), 2, 4)[:args.requests]
        prompts, segments = [prompt for _, prompt in items], [category for category, _ in items]
        for llm in llms.values():
            llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
        results = {name: {} for name in names}
        for i, c in enumerate(levels):
            for name in names[i % len(names):] + names[:i % len(names)]:
                point = run_closed_loop(llms[name], prompts, [args.max_tokens] * len(prompts), c, segments=segments)
                results[name][str(c)] = point
                print(f"{name} c={c}: {point['tokens_per_s']:.1f} tok/s, p95 {point['p95']:.1f} s", flush=True)
                RESULTS.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps(results))
    plot(results, levels)
    command = f"python bench/concurrency.py --levels {args.levels} --requests {args.requests} --max-tokens {args.max_tokens}"
    body = report(results, levels, args)
    write_section("concurrency", command, body, {n: {c: {k: v for k, v in p.items() if k != "outputs"}
                                                      for c, p in r.items()} for n, r in results.items()})
    print(body)


if __name__ == "__main__":
    main()
