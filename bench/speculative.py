"""Speculative vs plain decoding on HumanEval prompts: speed, acceptance, and equality with plain.

    python bench/speculative.py [--prompts 20] [--max-tokens 128] [--ks 1,2,3,4,6,8]

Greedy, batch 1, the real pair (qwen2.5-coder-1.5b target, qwen2.5-coder-0.5b draft; weights as --quantization), one
process, one target: plain decoding first (the baseline), then each method at each fixed k (the
adaptive controller off: every step drafts exactly k tokens, fewer only where a request has fewer
left or n-gram finds a shorter match). Speedup =
mean per-prompt tokens/s of the config / that of plain (Spec-Bench's definition,
prefill included); the decode-only speedup leaves the (identical) prefill out. Mean acceptance
length counts the recovered/bonus token (plain = 1.00). Every output is compared with plain's.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import RESULTS, table, write_section  # noqa: E402
from draftwise import LLM, SamplingParams  # noqa: E402

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "humaneval.jsonl.gz"


def humaneval_prompts(count: int) -> list[str]:
    with gzip.open(DATA, "rt") as handle:
        return [json.loads(line)["prompt"] for line in handle][:count]


def run(llm: LLM, prompts: list[str], params: SamplingParams) -> dict:
    outputs = [llm.generate(prompt, params)[0] for prompt in prompts]
    metrics = llm.spec_metrics
    return {
        "tokens_per_s": statistics.mean(o.metrics.tokens_per_second for o in outputs),
        "decode_tokens_per_s": statistics.mean(o.metrics.decode_tokens_per_second for o in outputs),
        "token_ids": [o.token_ids for o in outputs],
        "acceptance_rate": metrics.acceptance_rate,
        "mean_acceptance_length": metrics.mean_acceptance_length if metrics.num_drafts else 1.0,
        "per_position": metrics.acceptance_rate_per_position,
        "draft_seconds": metrics.draft_seconds,
        "verify_seconds": metrics.verify_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ks", default="1,2,3,4,6,8")
    parser.add_argument("--methods", default="draft,ngram,layer_skip")
    parser.add_argument("--layer-skip-layers", type=int, default=20)
    parser.add_argument("--quantization", default="auto", help="weights of target and draft (auto = int4 on CPU)")
    parser.add_argument("--name", default="speculative", help="BENCHMARKS.md section and results file")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    prompts = humaneval_prompts(args.prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    command = (f"python bench/speculative.py --prompts {args.prompts} --max-tokens {args.max_tokens} --ks {args.ks} "
               f"--quantization {args.quantization}")
    if args.methods != "draft,ngram,layer_skip":
        command += f" --methods {args.methods}"
    if args.name != "speculative":
        command += f" --name {args.name}"

    llm = LLM("qwen2.5-coder-1.5b", max_num_seqs=1, max_model_len=2048, progress=False,
              quantization=args.quantization)
    llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    results = {"plain": run(llm, prompts, params)}
    plain = results["plain"]
    print(f"plain {plain['tokens_per_s']:.2f} tok/s", flush=True)
    specs = {
        "draft": lambda k: {"method": "draft", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": k,
                            "quantization": args.quantization, "adaptive": False},
        "ngram": lambda k: {"method": "ngram", "num_speculative_tokens": k, "adaptive": False},
        "layer_skip": lambda k: {"method": "layer_skip", "num_layers": args.layer_skip_layers,
                                 "num_speculative_tokens": k, "adaptive": False},
    }
    for method in args.methods.split(","):
        for k in ks:
            llm.set_speculative(specs[method](k), progress=False)
            name = f"{method} k={k}"
            results[name] = run(llm, prompts, params)
            r = results[name]
            print(f"{name}: {r['tokens_per_s'] / plain['tokens_per_s']:.2f}x "
                  f"(decode {r['decode_tokens_per_s'] / plain['decode_tokens_per_s']:.2f}x), acceptance {r['acceptance_rate']:.0%},"
                  f" mean length {r['mean_acceptance_length']:.2f}", flush=True)
            RESULTS.mkdir(parents=True, exist_ok=True)
            (RESULTS / f"{args.name}-partial.json").write_text(json.dumps(results))

    rows = []
    for name, r in results.items():
        equal = sum(a == b for a, b in zip(r["token_ids"], plain["token_ids"]))
        positions = " ".join(f"{p:.2f}" for p in r["per_position"]) or "-"
        share = (f"{r['draft_seconds'] / (r['draft_seconds'] + r['verify_seconds']):.0%}"
                 if r["draft_seconds"] + r["verify_seconds"] > 0 else "-")
        rows.append([name, f"{r['tokens_per_s']:.2f}", f"{r['tokens_per_s'] / plain['tokens_per_s']:.2f}x",
                     f"{r['decode_tokens_per_s'] / plain['decode_tokens_per_s']:.2f}x",
                     f"{r['acceptance_rate']:.0%}" if name != "plain" else "-",
                     f"{r['mean_acceptance_length']:.2f}", positions, share, f"{equal}/{len(prompts)}"])
    body = (f"HumanEval, first {len(prompts)} prompts, up to {args.max_tokens} new tokens, greedy, batch 1, "
            f"weights `{args.quantization}` (target and draft); "
            f"layer_skip drafts with the first {args.layer_skip_layers} of 28 layers.\n\n"
            + table(["config", "tok/s (with prefill)", "speedup", "decode-only speedup", "acceptance", "mean acc. length (incl. bonus)",
                     "acceptance by position", "time drafting", "outputs = plain"], rows))
    write_section(args.name, command, body, {k: {kk: vv for kk, vv in v.items() if kk != "token_ids"}
                                                 for k, v in results.items()})
    print(body)


if __name__ == "__main__":
    main()
