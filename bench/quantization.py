"""Weight formats side by side: fp32 (oneDNN), int8 and int4, for the default target and draft.

    python bench/quantization.py [--prompts 4] [--max-tokens 64] [--eval-tokens 1536]

One run: load time, plain greedy decoding tokens/s (batch 1), the cost of a forward over n new
tokens (n = 1..6, 8, 16), and quality against the fp32 model: top-1 agreement and perplexity
on a text sample we ship (draftwise's own source files), teacher-forced in 512-token windows.
int8 and int4 run twice: on draftwise's native low-bit kernels and on PyTorch's packed kernels.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.plain_decoding import forward_costs, humaneval_prompts  # noqa: E402
from bench.report import table, write_section  # noqa: E402
from draftwise import LLM, SamplingParams  # noqa: E402
from draftwise.quant import native  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_FILES = ["draftwise/spec/verify.py", "draftwise/engine/engine.py", "draftwise/model/attention.py",
                "README.md"]
FORMATS = [("none", True), ("int8", True), ("int4", True), ("int8", False), ("int4", False)]  # (weights, native)
SIZES = (1, 2, 3, 4, 5, 6, 8, 16)
MODELS = ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]
WINDOW = 512


def sample_ids(llm: LLM, count: int) -> list[int]:
    text = "\n\n".join((ROOT / name).read_text() for name in SAMPLE_FILES)
    return llm.tokenizer.encode(text)[:count]


@torch.inference_mode()
def teacher_forced(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Log-probabilities [len(ids) - 1, V] of each next token, in windows of WINDOW tokens."""
    rows = []
    for start in range(0, len(ids) - 1, WINDOW):
        window = ids[start:start + WINDOW + 1]
        logits = llm.model(torch.tensor([window[:-1]]), torch.arange(len(window) - 1)[None])[0]
        rows.append(logits.float().log_softmax(-1))
    return torch.cat(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--eval-tokens", type=int, default=1536)
    args = parser.parse_args()
    prompts = humaneval_prompts(args.prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    speed_rows, cost_rows, quality_rows, data = [], [], [], {}
    for name in MODELS:
        reference_logprobs = None
        for fmt, use_native in FORMATS:
            native.set_enabled(use_native)
            label = fmt if fmt == "none" or use_native else f"{fmt} (PyTorch kernels)"
            start = time.perf_counter()
            llm = LLM(name, max_num_seqs=1, progress=False, quantization=fmt)
            load_seconds = time.perf_counter() - start
            llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4))  # warm-up
            outputs = [llm.generate(prompt, params)[0] for prompt in prompts]
            decode = statistics.mean(o.metrics.decode_tokens_per_second for o in outputs)
            costs = forward_costs(llm.runner, sizes=SIZES)
            ids = sample_ids(llm, args.eval_tokens)
            logprobs = teacher_forced(llm, ids)
            targets = torch.tensor(ids[1:])
            nll = -logprobs[torch.arange(len(targets)), targets].mean().item()
            if reference_logprobs is None:
                reference_logprobs = logprobs
            agreement = (logprobs.argmax(-1) == reference_logprobs.argmax(-1)).float().mean().item()
            report = llm.model.quantization.summary() if fmt != "none" else "fp32, oneDNN-packed"
            speed_rows.append([name, label, f"{load_seconds:.1f}", f"{decode:.2f}", report])
            cost_rows.append([name, label, f"{costs[1] * 1000:.0f}"] + [f"{costs[n] / costs[1]:.2f}" for n in SIZES])
            quality_rows.append([name, label, f"{math.exp(nll):.3f}", f"{agreement:.1%}", len(targets)])
            data[f"{name}/{label}"] = {"load_seconds": load_seconds, "decode_tokens_per_s": decode,
                                     "forward_seconds": costs, "perplexity": math.exp(nll),
                                     "top1_agreement_with_fp32": agreement, "quantization": report}
            print(speed_rows[-1], cost_rows[-1], quality_rows[-1], flush=True)
            del llm

    body = (
        f"Greedy, batch 1, {len(prompts)} HumanEval prompts x {args.max_tokens} tokens (EOS ignored); "
        "`none` = fp32 weights through oneDNN; int8/int4 on draftwise's native kernels, then on PyTorch's packed "
        "kernels (load times include building each path's packed-weight cache if absent). llama.cpp on this machine decodes the 1.5B at about "
        "13 tokens/s (../shared/MODELS.md).\n\n"
        + table(["model", "weights", "load s", "decode tok/s", "layers"], speed_rows)
        + "\n\nForward over n new tokens (256-token context), relative to n = 1 of the same format:\n\n"
        + table(["model", "weights", "n=1 ms"] + [f"n={n}" for n in SIZES], cost_rows)
        + f"\n\nQuality on a text sample we ship ({', '.join(SAMPLE_FILES)}; teacher-forced, "
          f"{WINDOW}-token windows): perplexity, and how often the top-1 token equals the fp32 model's.\n\n"
        + table(["model", "weights", "perplexity", "top-1 = fp32", "tokens"], quality_rows)
    )
    write_section("quantization", "python bench/quantization.py", body, data)
    print(body)


if __name__ == "__main__":
    main()
