"""`draftwise bench`: plain decoding against speculative configs, interleaved, on Spec-Bench, HumanEval or JSONL."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftwise.cli.speculative_flags import add_option_arguments, drafter_options_from_args
from draftwise.errors import InvalidParameterError
from draftwise.loading.registry import DEFAULT_DRAFT, DEFAULT_TARGET


def add_parser(commands) -> None:
    from draftwise.benchmark.runner import default_configs

    bench = commands.add_parser("bench", help="plain vs speculative configs on Spec-Bench, HumanEval or your JSONL")
    bench.add_argument("--model", default=DEFAULT_TARGET)
    bench.add_argument("--dataset", action="append", default=None,
                       help="spec-bench, humaneval or a JSONL path (repeatable; default: spec-bench and humaneval)")
    bench.add_argument("--configs", default=",".join(default_configs()),
                       help="comma-separated: METHOD (adaptive), METHOD:k=K (fixed) or METHOD:k<=K; plain always runs")
    bench.add_argument("--per-category", type=int, default=10, help="prompts per category (HumanEval: in all)")
    bench.add_argument("--max-tokens", type=int, default=128)
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--all-turns", action="store_true", help="Spec-Bench: every turn, not just the first")
    bench.add_argument("--peers", choices=["hf"], default=None,
                       help="also run Hugging Face transformers on the same GGUF weights (plain, assistant, prompt lookup)")
    bench.add_argument("--output", default="bench-results", help="folder for bench.md, bench.json and plots")
    add_option_arguments(bench)
    bench.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from draftwise.llm import LLM
    from draftwise.sampling.params import SamplingParams
    from draftwise.benchmark.datasets import load_prompts
    from draftwise.benchmark.report import markdown, write_outputs
    from draftwise.benchmark.runner import config_method, draftwise_configs, run_benchmark, summarize

    configs = [c for c in args.configs.split(",") if c]
    methods = list(dict.fromkeys(config_method(config) for config in configs if config != "plain"))  # typos fail here
    options = drafter_options_from_args(args, methods)
    if args.per_category < 1 or args.max_tokens < 1:
        raise InvalidParameterError("--per-category and --max-tokens must be positive")
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    print(f"loading the target for plain and {len(configs)} configs" + (" and the hf peers" if args.peers else ""),
          file=sys.stderr, flush=True)
    contestants = draftwise_configs(lambda: LLM(args.model, max_num_seqs=1, progress=False), configs, params,
                                    options)
    tokenizer = contestants[0].llm.tokenizer
    prompts = []
    for dataset in args.dataset or ["spec-bench", "humaneval"]:
        prompts += load_prompts(dataset, tokenizer, per_category=args.per_category, all_turns=args.all_turns,
                                max_tokens=args.max_tokens, seed=args.seed)
    if args.peers == "hf":
        from draftwise.benchmark.peers import hf_configs

        contestants += hf_configs(args.model, getattr(args, "option_model", None) or DEFAULT_DRAFT, args.max_tokens)
    results = run_benchmark(contestants, prompts)
    summary = summarize(results)
    header = (f"{args.model}: {len(prompts)} prompts, up to {args.max_tokens} tokens, temperature "
              f"{args.temperature}, seed {args.seed}, batch 1, configs interleaved prompt by prompt.")
    paths = write_outputs(results, summary, Path(args.output), header)
    print(markdown(summary, header))
    print(f"\nwritten: {', '.join(str(p) for p in paths.values())}")
