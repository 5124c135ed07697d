"""Plain decoding on this machine: load time, decode and prefill speed, forward cost over n tokens.

    python bench/plain_decoding.py [--prompts 4] [--max-tokens 64]

Greedy, batch 1, fp32 weights (quantization="none"; bench/quantization.py covers int4/int8). The forward-cost curve (n = 1, 2, 4, 8, 16 new tokens on a warm cache) is
what speculative decoding's economics rest on: verifying k drafted tokens costs a pass over k+1.
It is measured for our default CPU path (oneDNN-prepacked weights) and for plain `F.linear`
weights in the same run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import table, write_section  # noqa: E402
from draftwise import LLM, SamplingParams  # noqa: E402
from draftwise.loading.hf_folder import load_model  # noqa: E402
from draftwise.loading.resolve import resolve_model  # noqa: E402
from draftwise.runner.model_runner import ModelRunner  # noqa: E402

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "humaneval.jsonl.gz"
MODELS = ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]
SIZES = [1, 2, 4, 8, 16]


def humaneval_prompts(count: int) -> list[str]:
    with gzip.open(DATA, "rt") as handle:
        return [json.loads(line)["prompt"] for line in handle][:count]


def forward_costs(runner: ModelRunner, context: int = 256, repeats: int = 5,
                  sizes: tuple[int, ...] = SIZES) -> dict[int, float]:
    """Median seconds of one forward over n new tokens appended to a `context`-token row."""
    row = runner.allocate()
    runner.forward([row], [[100 + i % 1000 for i in range(context)]], [1])
    costs = {}
    for n in sizes:
        samples = []
        for attempt in range(repeats + 1):
            start = time.perf_counter()
            runner.forward([row], [[7] * n], [n])
            elapsed = time.perf_counter() - start
            runner.truncate(row, context)
            if attempt:  # the first is a warm-up
                samples.append(elapsed)
        costs[n] = statistics.median(samples)
    runner.free(row)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    prompts = humaneval_prompts(args.prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    rows, cost_rows, data = [], [], {}
    load_total = 0.0
    for name in MODELS:
        start = time.perf_counter()
        llm = LLM(name, max_num_seqs=1, progress=False, quantization="none")
        load_seconds = time.perf_counter() - start
        load_total += load_seconds
        llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        outputs = [llm.generate(prompt, params)[0] for prompt in prompts]
        decode = statistics.mean(o.metrics.decode_tokens_per_second for o in outputs)
        prefill = statistics.mean(o.metrics.num_prompt_tokens / o.metrics.time_to_first_token for o in outputs)
        packed = forward_costs(llm.runner)
        del llm
        plain_model = load_model(resolve_model(name), pack_cpu_weights=False)
        unpacked = forward_costs(ModelRunner(plain_model, 1, 512))
        del plain_model
        rows.append([name, f"{load_seconds:.1f}", f"{decode:.2f}", f"{prefill:.1f}",
                     f"{1 / unpacked[1]:.2f}"])
        for label, costs in (("oneDNN packed (default)", packed), ("F.linear", unpacked)):
            cost_rows.append([name, label, f"{costs[1] * 1000:.0f}"] + [f"{costs[n] / costs[1]:.2f}" for n in SIZES])
        data[name] = {"load_seconds": load_seconds, "decode_tokens_per_s": decode, "prefill_tokens_per_s": prefill,
                      "forward_seconds_packed": packed, "forward_seconds_f_linear": unpacked}
        print(rows[-1], flush=True)

    body = (
        f"Plain decoding, greedy, batch 1, fp32, {len(prompts)} HumanEval prompts x {args.max_tokens} tokens "
        f"(EOS ignored). Load = `LLM(name)` from the converted cache; both default models together: "
        f"{load_total:.1f} s.\n\n"
        + table(["model", "load s", "decode tok/s", "prefill tok/s", "F.linear step/s (baseline)"], rows)
        + "\n\nCost of one forward pass over n new tokens (256-token context), relative to n = 1:\n\n"
        + table(["model", "weights", "n=1 ms"] + [f"n={n}" for n in SIZES], cost_rows)
    )
    write_section("plain-decoding", "python bench/plain_decoding.py", body, data)
    print(body)


if __name__ == "__main__":
    main()
