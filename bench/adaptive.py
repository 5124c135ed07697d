"""Adaptive vs fixed speculation on Spec-Bench and HumanEval: per-category speedup over plain decoding.

    python bench/adaptive.py [--per-category 8] [--humaneval 20] [--max-tokens 128]

Greedy, batch 1, the default weights (int4 target; int4_all draft with a 32k-token head), one
process, one run. Spec-Bench: the first turn of the first `--per-category` questions of each of its
six categories (multi-turn conversation = MT-bench: the first question of each of its eight
subcategories; translation, summarization, QA, math reasoning, RAG), in the chat template;
HumanEval prompts as raw code completions. Configs: plain decoding (the baseline); each drafter
adaptive (the default: k <= 8 chosen per step by the goodput controller); each drafter at a fixed
k, the best one found by bench/speculative.py (run 2, native kernels: draft 3, ngram 3,
layer_skip 1).

Speedup = (tokens / seconds of the config) / (tokens / seconds of plain) over the category's
prompts, prefill included (Spec-Bench's definition). tau = generated tokens after the first per
target decoding step (plain = 1.00; Spec-Bench's mean accepted tokens). Every output is
compared with plain's. Each request carries its category as its traffic segment (the adaptive
controller keeps acceptance and length statistics per segment, as the server does for a request's
`segment` field).

Interleaved (the default since run 6): one LLM per config, and every prompt runs under each config
in turn, so this machine's drift (10-15% over tens of minutes) falls on all configs alike; in run 5,
run config after config, the draft model measured 1.16x on summarization with 6 drafts over its 8
requests: the machine ran at different speeds under the two. `--sequential` runs config after config.
Results are saved as they come (bench/results/<name>-partial.json); `--report-only` writes the
report from that file.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import RESULTS, table, write_section  # noqa: E402
from draftwise import LLM, SamplingParams  # noqa: E402

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
SPEC_BENCH_CATEGORIES = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
MT_BENCH = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
CONFIGS = {
    "plain": None,
    "draft adaptive": {"method": "draft"},
    "ngram adaptive": {"method": "ngram"},
    "layer_skip adaptive": {"method": "layer_skip", "num_layers": 20},
    "draft k=3": {"method": "draft", "num_speculative_tokens": 3, "adaptive": False},
    "ngram k=3": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
    "layer_skip k=1": {"method": "layer_skip", "num_layers": 20, "num_speculative_tokens": 1, "adaptive": False},
}
ADAPTIVE_K = 8


def workload(llm: LLM, per_category: int, humaneval: int) -> list[tuple[str, str]]:
    """(category, prompt) pairs: Spec-Bench first turns in the chat template, then HumanEval."""
    rows = [json.loads(line) for line in (DATA / "spec_bench_question.jsonl").read_text().splitlines() if line]
    chosen: list[tuple[str, str]] = []
    mt = [next(r for r in rows if r["category"] == sub) for sub in MT_BENCH][:per_category]
    chosen += [("mt_bench", r["turns"][0]) for r in mt]
    for category in SPEC_BENCH_CATEGORIES[1:]:
        chosen += [(category, r["turns"][0]) for r in rows if r["category"] == category][:per_category]
    items = [(category, llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
             for category, text in chosen]
    with gzip.open(DATA / "humaneval.jsonl.gz", "rt") as handle:
        items += [("humaneval", json.loads(line)["prompt"]) for line in handle][:humaneval]
    return items


def run_request(llm: LLM, category: str, prompt: str, params: SamplingParams) -> dict:
    start = time.perf_counter()
    output = llm.generate(prompt, params, segment=category)[0]
    seconds = time.perf_counter() - start
    spec = output.metrics.spec
    return {"category": category, "seconds": seconds, "tokens": len(output.token_ids),
            "token_ids": output.token_ids, "num_drafts": spec.num_drafts if spec else 0,
            "num_plain_steps": spec.num_plain_steps if spec else 0,
            "num_draft_tokens": spec.num_draft_tokens if spec else 0,
            "num_accepted_tokens": spec.num_accepted_tokens if spec else 0}


def run_config(llm: LLM, items: list[tuple[str, str]], params: SamplingParams) -> list[dict]:
    return [run_request(llm, category, prompt, params) for category, prompt in items]


def run_interleaved(llms: dict[str, LLM], items: list[tuple[str, str]], params: SamplingParams,
                    partial: Path) -> dict[str, list[dict]]:
    """Prompt by prompt, every config in turn (the starting config rotating), each with its own LLM:
    the machine's drift over the run then falls on every config alike instead of on whichever ran
    in a slow stretch. Each LLM's controller still sees the prompts in the same order."""
    names = list(llms)
    results: dict[str, list[dict]] = {name: [] for name in names}
    started = time.perf_counter()
    for i, (category, prompt) in enumerate(items):
        for name in names[i % len(names):] + names[:i % len(names)]:
            results[name].append(run_request(llms[name], category, prompt, params))
        print(f"{i + 1}/{len(items)} prompts, {time.perf_counter() - started:.0f} s", flush=True)
        partial.write_text(json.dumps(results))
    return results


def config_spec(name: str) -> dict | None:
    spec = CONFIGS[name]
    if spec is not None and spec.get("adaptive", True):
        spec = {**spec, "num_speculative_tokens": ADAPTIVE_K}
    return spec


def summarize(results: dict[str, list[dict]]) -> tuple[str, dict]:
    plain = results["plain"]
    categories = list(dict.fromkeys(r["category"] for r in plain)) + ["all"]

    def speed(rows):
        return sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows)

    def tau(rows, name):
        steps = sum(r["num_drafts"] + r["num_plain_steps"] for r in rows)
        return 1.0 if name == "plain" or not steps else sum(r["tokens"] - 1 for r in rows) / steps

    summary: dict = defaultdict(dict)
    speed_rows, tau_rows = [], []
    for name, rows in results.items():
        speeds, taus = [], []
        for category in categories:
            mine = [r for r in rows if category in ("all", r["category"])]
            base = [r for r in plain if category in ("all", r["category"])]
            ratio = speed(mine) / speed(base)
            equal = sum(a["token_ids"] == b["token_ids"] for a, b in zip(mine, base))
            summary[name][category] = {"speedup": ratio, "tau": tau(mine, name), "equal": equal, "count": len(mine),
                                       "tokens_per_s": speed(mine)}
            speeds.append(f"{ratio:.2f}x")
            taus.append(f"{tau(mine, name):.2f}")
        equal_all = summary[name]["all"]["equal"]
        speed_rows.append([name, *speeds, f"{equal_all}/{len(rows)}"])
        tau_rows.append([name, *taus])
    body = (table(["config", *categories, "outputs = plain"], speed_rows)
            + "\n\nMean tokens per target decoding step (tau, Spec-Bench's mean accepted tokens; plain = 1.00):\n\n"
            + table(["config", *categories], tau_rows))
    return body, summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--per-category", type=int, default=8)
    parser.add_argument("--humaneval", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--sequential", action="store_true",
                        help="one config after another on one LLM (runs 1-5) instead of prompt by prompt")
    parser.add_argument("--name", default="adaptive", help="BENCHMARKS.md section and results file")
    args = parser.parse_args()
    partial = RESULTS / f"{args.name}-partial.json"
    command = f"python bench/adaptive.py --per-category {args.per_category} --humaneval {args.humaneval} " \
              f"--max-tokens {args.max_tokens}"
    if args.configs != ",".join(CONFIGS):
        command += f" --configs '{args.configs}'"
    if args.name != "adaptive":
        command += f" --name {args.name}"
    if args.sequential:
        command += " --sequential"
    results: dict[str, list[dict]] = json.loads(partial.read_text()) if args.report_only else {}
    RESULTS.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    if not args.report_only and not args.sequential:
        # one LLM per config (~1.6 GB each with the int4 target); an adaptive config measures its
        # cost model on construction (cached on disk)
        llms = {name: LLM("qwen2.5-coder-1.5b", speculative=config_spec(name), max_num_seqs=1, max_model_len=4096,
                          progress=False) for name in args.configs.split(",")}
        items = workload(next(iter(llms.values())), args.per_category, args.humaneval)
        for llm in llms.values():
            llm.generate(items[0][1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
        results = run_interleaved(llms, items, params, partial)
    elif not args.report_only:
        llm = LLM("qwen2.5-coder-1.5b", max_num_seqs=1, max_model_len=4096, progress=False)
        items = workload(llm, args.per_category, args.humaneval)
        for name in args.configs.split(","):
            llm.set_speculative(config_spec(name), progress=False)  # an adaptive config measures its cost model here
            llm.generate(items[0][1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
            started = time.perf_counter()
            results[name] = run_config(llm, items, params)
            print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
            partial.write_text(json.dumps(results))
    body, summary = summarize(results)
    counts = defaultdict(int)
    for r in results["plain"]:
        counts[r["category"]] += 1
    intro = (f"Greedy, batch 1, up to {args.max_tokens} new tokens (EOS ends a request), default weights. Prompts: "
             + ", ".join(f"{c} {n}" for c, n in counts.items())
             + f". Adaptive configs: k <= {ADAPTIVE_K}, chosen per step. "
             + ("Configs one after another. " if args.sequential else
                "Interleaved: each prompt runs under every config in turn (one LLM per config). ")
             + "Speedup over plain decoding, prefill included:\n\n")
    write_section(args.name, command, intro + body, summary)
    print(intro + body)


if __name__ == "__main__":
    main()
