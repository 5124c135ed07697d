"""Two drafting options measured on their own: the trimmed draft LM head and randomized drafting.

    python bench/drafting_options.py [--prompts 8] [--max-tokens 96]

1. Draft step time of the 0.5B with its full 151,936-token head and with the 32,768-token head
   (the default), from the cost model's drafter timings (`draftwise profile` measures the same),
   and what the trimmed head does to acceptance on HumanEval (greedy, adaptive k).
2. Randomized drafting under sampling (temperature 0.8, top-p 0.95, seeded): plain decoding vs the
   draft model (fixed k = 2) drafting with probability a = 1, 0.7 and 0.5 per step. The output
   distribution is the target's in every case (tests/test_verify.py); what can change is speed.
Batch 1, default weights, one process, one run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import table, write_section  # noqa: E402
from bench.speculative import humaneval_prompts  # noqa: E402
from draftwise import LLM, SamplingParams  # noqa: E402


def timed(llm: LLM, prompts: list[str], params: SamplingParams) -> dict:
    tokens, seconds = 0, 0.0
    llm.spec_metrics = type(llm.spec_metrics)()
    for prompt in prompts:
        start = time.perf_counter()
        output = llm.generate(prompt, params)[0]
        seconds += time.perf_counter() - start
        tokens += len(output.token_ids)
    metrics = llm.spec_metrics
    first = metrics.acceptance_rate_per_position[0] if metrics.drafted_per_position else 0.0
    return {"tokens_per_s": tokens / seconds, "first_position_acceptance": first,
            "acceptance_rate": metrics.acceptance_rate, "num_drafts": metrics.num_drafts,
            "num_plain_steps": metrics.num_plain_steps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    command = f"python bench/drafting_options.py --prompts {args.prompts} --max-tokens {args.max_tokens}"
    prompts = humaneval_prompts(args.prompts)
    llm = LLM("qwen2.5-coder-1.5b", max_num_seqs=1, max_model_len=2048, progress=False)
    llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4))
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    data: dict = {"head": {}, "randomized": {}}

    head_rows = []
    llm.set_speculative(None)
    plain = timed(llm, prompts, greedy)
    for label, size in (("full (151,936)", None), ("trimmed (32,768)", 32768)):
        llm.set_speculative({"method": "draft", "num_speculative_tokens": 4, "draft_vocab_size": size})
        costs = llm.cost_model
        result = timed(llm, prompts, greedy)
        data["head"][label] = {"draft_1_ms": costs.draft_seconds(1) * 1e3, "draft_3_ms": costs.draft_seconds(3) * 1e3,
                               **result, "speedup": result["tokens_per_s"] / plain["tokens_per_s"]}
        head_rows.append([label, f"{costs.draft_seconds(1) * 1e3:.1f}", f"{costs.draft_seconds(3) * 1e3:.1f}",
                          f"{result['acceptance_rate']:.0%}", f"{result['tokens_per_s'] / plain['tokens_per_s']:.2f}x"])
        print(head_rows[-1], flush=True)

    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_tokens=args.max_tokens)
    llm.set_speculative(None)
    base = timed(llm, prompts, sampled)
    random_rows = [["plain", "-", "-", "-", "1.00x"]]
    for rate in (1.0, 0.7, 0.5):
        llm.set_speculative({"method": "draft", "num_speculative_tokens": 2, "adaptive": False,
                             "draft_probability": rate})  # fixed k: the adaptive controller may not draft at all
        result = timed(llm, prompts, sampled)
        data["randomized"][str(rate)] = {**result, "speedup": result["tokens_per_s"] / base["tokens_per_s"]}
        share = result["num_plain_steps"] / max(1, result["num_plain_steps"] + result["num_drafts"])
        random_rows.append([f"draft, a = {rate}", f"{result['first_position_acceptance']:.0%}",
                            f"{result['acceptance_rate']:.0%}", f"{share:.0%}",
                            f"{result['tokens_per_s'] / base['tokens_per_s']:.2f}x"])
        print(random_rows[-1], flush=True)

    body = (f"HumanEval, first {args.prompts} prompts, up to {args.max_tokens} new tokens, batch 1, default weights.\n\n"
            "Draft LM head (greedy, adaptive k <= 4): draft-model time per propose call from the measured cost "
            "model, acceptance, and speedup over plain decoding:\n\n"
            + table(["draft head", "propose 1 token ms", "propose 3 tokens ms", "acceptance", "speedup"], head_rows)
            + "\n\nRandomized drafting under sampling (temperature 0.8, top-p 0.95, seed 1; fixed k = 2): "
            "first-position acceptance when a draft is verified, overall acceptance, share of decode steps "
            "without a verified draft, speedup over plain sampling:\n\n"
            + table(["config", "accepted at position 1", "acceptance", "steps without draft", "speedup"],
                    random_rows))
    write_section("drafting-options", command, body, data)
    print(body)


if __name__ == "__main__":
    main()
