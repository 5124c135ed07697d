"""Command line: `draftwise generate`, `draftwise profile`, `draftwise models`."""

from __future__ import annotations

import argparse
import sys

from draftwise.errors import DraftwiseError, InvalidParameterError


def _generate(args: argparse.Namespace) -> None:
    from draftwise.llm import LLM
    from draftwise.sampling.params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, stop=args.stop or None)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=1, speculative=_speculative(args),
              quantization=args.quantization)
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    if not args.chat:
        print(prompt, end="", flush=True)
    final = None
    for delta in llm.stream(prompt, params):
        print(delta.text, end="", flush=True)
        final = delta.output
    print()
    if final is not None:
        print(f"[{final.metrics.summary()}; finish: {final.finish_reason}]", file=sys.stderr)


def _speculative(args: argparse.Namespace) -> dict | None:
    if not args.method:
        return None
    speculative = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens,
                   "adaptive": not args.fixed_k, "draft_confidence_threshold": args.confidence,
                   "draft_probability": args.draft_probability}
    if args.method == "draft" and args.draft:
        speculative["model"] = args.draft
    if args.method == "draft" and args.draft_vocab_size is not None:
        speculative["draft_vocab_size"] = args.draft_vocab_size or None  # 0: the full vocabulary
    if args.method == "draft" and args.draft_context_window is not None:
        speculative["draft_context_window"] = args.draft_context_window or None  # 0: the whole context
    if args.method == "layer_skip" and args.layers:
        speculative["num_layers"] = args.layers
    return speculative


def _profile(args: argparse.Namespace) -> None:
    from draftwise.adaptive.controller import best_num_tokens, expected_tokens
    from draftwise.llm import LLM

    speculative = _speculative(args)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=1, quantization=args.quantization)
    if speculative is not None:
        speculative["adaptive"] = False  # measured below, with --refresh honoured
        llm.set_speculative(speculative)
    proposer = llm.engine.drafters[llm.default_method].proposer if llm.default_method else None
    costs = llm.measure_costs(proposer, llm.speculative, refresh=args.refresh)
    print(f"cost model: {costs.key}\n")
    print(costs.table())
    if speculative is None:
        return
    plain = costs.step_seconds(0)
    print(f"\nBest k per acceptance rate (constant over positions; k <= {args.num_speculative_tokens}):\n")
    print("| acceptance | best k | tokens/step | speedup over plain |\n|---|---|---|---|")
    for rate in (0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95):
        rates = [rate] * args.num_speculative_tokens
        k = best_num_tokens(rates, costs, args.num_speculative_tokens)
        tokens = expected_tokens(rates, k)
        print(f"| {rate:.2f} | {k} | {tokens:.2f} | {tokens / costs.step_seconds(k) * plain:.2f}x |")


def _add_model_arguments(command: argparse.ArgumentParser, default_model: str) -> None:
    command.add_argument("--model", default=default_model, help="known name, GGUF file or HF folder")
    command.add_argument("--method", choices=["draft", "ngram", "layer_skip"], default=None,
                         help="speculate with a draft model, prompt lookup, or the target's first layers")
    command.add_argument("--draft", default=None, help="draft model for --method draft (default qwen2.5-coder-0.5b)")
    command.add_argument("-k", "--num-speculative-tokens", type=int, default=5,
                         help="most tokens drafted per step (exactly this many with --fixed-k)")
    command.add_argument("--fixed-k", action="store_true", help="always draft k tokens (default: adaptive k)")
    command.add_argument("--confidence", type=float, default=0.0,
                         help="stop drafting after a token drafted with less probability (0: never)")
    command.add_argument("--draft-vocab-size", type=int, default=None,
                         help="draft LM head over the N most frequent tokens only (default 32768; 0: all)")
    command.add_argument("--draft-context-window", type=int, default=None,
                         help="the draft model reads only the last N tokens (default 128; 0: all)")
    command.add_argument("--draft-probability", type=float, default=1.0,
                         help="randomized drafting: draft with this probability per step")
    command.add_argument("--layers", type=int, default=None, help="layers drafting for --method layer_skip")
    command.add_argument("--quantization", default="auto", choices=["auto", "int4", "int4_all", "int8", "none"],
                         help="weights: auto = int4 on CPU (Q4_K kept as stored, int8 for wider types)")
    command.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if present)")
    command.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: fp32 on CPU)")


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from draftwise.llm import LLM
    from draftwise.server.app import build_app
    from draftwise.server.async_engine import AsyncEngine

    kv_bytes = int(args.kv_cache_memory_gb * 2**30) if args.kv_cache_memory_gb else None
    llm = LLM(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, kv_cache_memory_bytes=kv_bytes,
              speculative=_speculative(args))
    engine = AsyncEngine(llm)
    app = build_app(engine, args.served_model_name or args.model, api_key=args.api_key)
    print(f"serving {args.model} on http://{args.host}:{args.port}/v1"
          + (f" (speculation: {llm.default_method})" if llm.default_method else ""), file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=10)


def _models(args: argparse.Namespace) -> None:
    from draftwise.loading.cache_dir import CACHE_ENV, cache_root
    from draftwise.loading.registry import DEFAULT_DRAFT, DEFAULT_TARGET, KNOWN_MODELS
    from draftwise.loading.resolve import known_model_file

    print(f"cache: {cache_root()}  (set {CACHE_ENV} to move it)")
    for name, model in KNOWN_MODELS.items():
        role = " [default target]" if name == DEFAULT_TARGET else " [default draft]" if name == DEFAULT_DRAFT else ""
        path = known_model_file(name)
        state = f"assembled at {path}" if path.is_file() else "not fetched yet (fetched on first use)"
        print(f"{name:<22}{model.description}{role}\n{'':<22}{model.size / 2**20:,.0f} MiB, {state}")


def build_parser() -> argparse.ArgumentParser:
    from draftwise.loading.registry import DEFAULT_TARGET

    parser = argparse.ArgumentParser(prog="draftwise", description="Lossless speculative decoding for LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text from a prompt, streaming it")
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", help="stop string (repeatable)")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_model_arguments(generate, DEFAULT_TARGET)
    generate.set_defaults(run=_generate)

    profile = commands.add_parser("profile", help="measure (or show the cached) costs speculation is planned with")
    _add_model_arguments(profile, DEFAULT_TARGET)
    profile.add_argument("--refresh", action="store_true", help="measure again even if a cached profile exists")
    profile.set_defaults(run=_profile)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    _add_model_arguments(serve, DEFAULT_TARGET)
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    serve.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    serve.add_argument("--max-num-seqs", type=int, default=8, help="requests decoded together")
    serve.add_argument("--max-model-len", type=int, default=4096, help="context length")
    serve.add_argument("--kv-cache-memory-gb", type=float, default=None,
                       help="KV cache budget (default: max-num-seqs x max-model-len tokens)")
    serve.set_defaults(run=_serve)

    bench = commands.add_parser("bench", help="plain vs speculative configs on Spec-Bench, HumanEval or your JSONL")
    bench.add_argument("--model", default=DEFAULT_TARGET)
    bench.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft model for draft configs")
    bench.add_argument("--dataset", action="append", default=None,
                       help="spec-bench, humaneval or a JSONL path (repeatable; default: spec-bench and humaneval)")
    bench.add_argument("--configs", default="draft,ngram",
                       help="comma-separated: METHOD (adaptive), METHOD:k=K (fixed) or METHOD:k<=K; plain always runs")
    bench.add_argument("--per-category", type=int, default=10, help="prompts per category (HumanEval: in all)")
    bench.add_argument("--max-tokens", type=int, default=128)
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--all-turns", action="store_true", help="Spec-Bench: every turn, not just the first")
    bench.add_argument("--layers", type=int, default=None, help="layers drafting for layer_skip configs")
    bench.add_argument("--peers", choices=["hf"], default=None,
                       help="also run Hugging Face transformers on the same GGUF weights (plain, assistant, prompt lookup)")
    bench.add_argument("--output", default="bench-results", help="folder for bench.md, bench.json and plots")
    bench.set_defaults(run=_bench)

    plan = commands.add_parser("plan", help="predict, from your traffic, whether speculation pays at your concurrency")
    plan.add_argument("--traffic", required=True, help="JSONL: one request per line (prompt, messages or turns)")
    plan.add_argument("--model", default=DEFAULT_TARGET)
    plan.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft model for the 'draft' drafter")
    plan.add_argument("--drafters", default="draft,ngram", help="comma-separated: draft, ngram, layer_skip")
    plan.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels to predict")
    plan.add_argument("--sample", type=int, default=24, help="requests sampled from the traffic (evenly by segment)")
    plan.add_argument("--max-tokens", type=int, default=128, help="generation cap for lines without max_tokens")
    plan.add_argument("-k", "--max-k", type=int, default=6, help="largest k considered (acceptance measured at it)")
    plan.add_argument("--segment-field", default=None, help="the field naming a request's segment (default: "
                      "segment, else category)")
    plan.add_argument("--price-per-mtok", type=float, default=None, help="today's cost of a million generated tokens")
    plan.add_argument("--tokens-per-day", type=float, default=None)
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--validate", action="store_true", help="run the real engine and compare with the prediction")
    plan.add_argument("--validate-max-concurrency", type=int, default=4)
    plan.add_argument("--output", default="plan", help="folder for plan.md, plan.json and plan.png")
    plan.set_defaults(run=_plan)

    models = commands.add_parser("models", help="list known models and where they are cached")
    models.set_defaults(run=_models)
    return parser


def _bench(args) -> None:
    from pathlib import Path

    from draftwise import LLM, SamplingParams
    from draftwise.benchmark.datasets import load_prompts
    from draftwise.benchmark.report import markdown, write_outputs
    from draftwise.benchmark.runner import draftwise_configs, parse_config, run_benchmark, summarize

    configs = [c for c in args.configs.split(",") if c]
    for config in configs:
        parse_config(config)  # a typo fails before any model loads
    if args.per_category < 1 or args.max_tokens < 1:
        raise InvalidParameterError("--per-category and --max-tokens must be positive")
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    print(f"loading the target for plain and {len(configs)} configs" + (" and the hf peers" if args.peers else ""),
          file=sys.stderr, flush=True)
    contestants = draftwise_configs(lambda: LLM(args.model, max_num_seqs=1, progress=False), configs, params,
                                    draft_model=args.draft, layers=args.layers)
    tokenizer = contestants[0].llm.tokenizer
    prompts = []
    for dataset in args.dataset or ["spec-bench", "humaneval"]:
        prompts += load_prompts(dataset, tokenizer, per_category=args.per_category, all_turns=args.all_turns,
                                max_tokens=args.max_tokens, seed=args.seed)
    if args.peers == "hf":
        from draftwise.benchmark.peers import hf_configs

        contestants += hf_configs(args.model, args.draft, args.max_tokens)
    results = run_benchmark(contestants, prompts)
    summary = summarize(results)
    header = (f"{args.model}: {len(prompts)} prompts, up to {args.max_tokens} tokens, temperature "
              f"{args.temperature}, seed {args.seed}, batch 1, configs interleaved prompt by prompt.")
    paths = write_outputs(results, summary, Path(args.output), header)
    print(markdown(summary, header))
    print(f"\nwritten: {', '.join(str(p) for p in paths.values())}")


def _plan(args) -> None:
    from pathlib import Path

    from draftwise.planner.plan import PlanOptions, make_plan, render, write

    def levels(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            values = ()
        if not values or min(values) < 1:
            raise InvalidParameterError(f"--concurrency must list positive integers, got {text!r}")
        return values

    drafters = tuple(d for d in args.drafters.split(",") if d)
    unknown = set(drafters) - {"draft", "ngram", "layer_skip"}
    if unknown or not drafters:
        raise InvalidParameterError(f"--drafters must name draft, ngram or layer_skip, got {args.drafters!r}")
    if args.max_k < 1 or args.sample < 1 or args.max_tokens < 1:
        raise InvalidParameterError("--max-k, --sample and --max-tokens must be positive")
    options = PlanOptions(args.traffic, args.model, drafters, args.draft, levels(args.concurrency), args.sample,
                          args.max_tokens, args.max_k, args.segment_field, args.price_per_mtok, args.tokens_per_day,
                          args.seed, args.validate, args.validate_max_concurrency)
    plan = make_plan(options, progress=lambda line: print(line, file=sys.stderr, flush=True))
    paths = write(plan, Path(args.output))
    print(render(plan))
    print(f"\nwritten: {', '.join(str(p) for p in paths.values())}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except DraftwiseError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
