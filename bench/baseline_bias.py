"""Do identical LLMs built in one process run at the same speed? (the baseline bias)

    python bench/baseline_bias.py [--copies 3] [--per-category 1] [--max-tokens 128]

Every interleaved benchmark builds one LLM per config in one process and compares their speeds.
Adaptive run 6 measured a config that took plain steps 99.8% of the time at 1.05x plain, and a
control with two plain LLMs had them 2% apart, the first built the slowest. This benchmark builds
`--copies` identical plain LLMs (default weights, greedy, batch 1) and runs each prompt under each
of them in turn, the first rotating by one per prompt (`draftwise.benchmark.runner`), so every copy
runs at every turn equally often when the prompt count is a multiple of the copies. It separates:

- copy: each copy's seconds over all prompts, relative to the mean of the copies (1.00 = no bias);
- turn: the seconds of the request run 1st, 2nd, ... in a prompt's round, relative to that prompt's
  mean over the copies (a cache or allocator effect of what ran just before);
- alignment: the smallest power of two (up to 4096) dividing the address of each copy's weight
  tensors over 1 MiB (vectorized int4 kernels read 32- or 64-byte lines).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import table, write_section  # noqa: E402
from draftwise import LLM, SamplingParams  # noqa: E402
from draftwise.benchmark.datasets import load_prompts  # noqa: E402
from draftwise.benchmark.runner import DraftwiseConfig, run_benchmark  # noqa: E402
from draftwise.planner.plan import module_tensors  # noqa: E402


def weight_alignment(llm: LLM, min_bytes: int = 2**20) -> int:
    """The largest power of two (<= 4096) dividing the address of every tensor over `min_bytes`."""
    worst = 4096
    for tensor in module_tensors(llm.model):
        if tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() >= min_bytes:
            address = tensor.data_ptr()
            worst = min(worst, address & -address if address else 4096)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--per-category", type=int, default=1, help="Spec-Bench prompts per category (and HumanEval)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--name", default="baseline-bias")
    args = parser.parse_args()

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    copies = [DraftwiseConfig(f"plain {i + 1}", LLM(max_num_seqs=1, progress=False), params)
              for i in range(args.copies)]
    tokenizer = copies[0].llm.tokenizer
    prompts = []
    for dataset in ("spec-bench", "humaneval"):
        prompts += load_prompts(dataset, tokenizer, per_category=args.per_category, max_tokens=args.max_tokens)
    results = run_benchmark(copies, prompts)

    n = len(copies)
    seconds = [[r.seconds for r in result.requests] for result in results]  # [copy][prompt]
    means = [sum(seconds[c][p] for c in range(n)) / n for p in range(len(prompts))]
    copy_rows = []
    for c, result in enumerate(results):
        total = sum(seconds[c])
        copy_rows.append([result.name, f"{sum(r.tokens for r in result.requests) / total:.2f}",
                          f"{total / sum(means):.3f}", weight_alignment(copies[c].llm),
                          f"{sum(a.token_ids == b.token_ids for a, b in zip(result.requests, results[0].requests))}"
                          f"/{len(prompts)}"])
    turn_rows = []
    for turn in range(n):
        # prompt p runs copy (p + turn) % n at this turn
        ratios = [seconds[(p + turn) % n][p] / means[p] for p in range(len(prompts))]
        turn_rows.append([turn + 1, f"{sum(ratios) / len(ratios):.3f}", f"{min(ratios):.3f}", f"{max(ratios):.3f}"])
    body = (f"{n} identical plain LLMs (default weights) built one after another in one process; "
            f"{len(prompts)} prompts (Spec-Bench {args.per_category} per category, HumanEval "
            f"{args.per_category}), greedy, batch 1, up to {args.max_tokens} tokens, interleaved with the "
            f"first copy rotating.\n\n"
            + table(["copy (build order)", "tokens/s", "seconds / mean of copies", "weight alignment, bytes",
                     "outputs = copy 1"], copy_rows)
            + "\n\n" + table(["turn in a prompt's round", "seconds / prompt mean", "min", "max"], turn_rows) + "\n")
    print(body)
    command = "python bench/baseline_bias.py " + " ".join(sys.argv[1:])
    write_section(args.name, command.strip(), body,
                  {"copies": copy_rows, "turns": turn_rows, "seconds": seconds, "prompts": [c for c, _ in prompts]})


if __name__ == "__main__":
    main()
