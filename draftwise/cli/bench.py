"""`draftwise bench --suite NAME`: the benchmark suites (`draftwise.benchmark.suites`), one runner for all."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from draftwise.output_paths import output_file, output_folder
from draftwise.cli.speculative_flags import add_option_arguments, drafter_options_from_args, speculative_arguments
from draftwise.errors import InvalidParameterError
from draftwise.loading.registry import DEFAULT_TARGET


def add_parser(commands) -> None:
    from draftwise.benchmark.suites import SUITES

    bench = commands.add_parser("bench", help="benchmark suites: plain vs speculative configs, formats, load ...",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="suites:\n" + "\n".join(f"  {name:17} {summary}"
                                                                    for name, (_, summary) in SUITES.items()))
    bench.add_argument("--suite", choices=list(SUITES), default="speculative")
    bench.add_argument("--model", default=DEFAULT_TARGET)
    bench.add_argument("--dataset", action="append", default=None,
                       help="spec-bench, humaneval, suffix-workload (code edits, follow-ups, repeated requests) or a JSONL path (repeatable; default: the suite's)")
    bench.add_argument("--configs", default=None,
                       help="comma-separated: METHOD (adaptive), METHOD:k=K (fixed) or METHOD:k<=K; plain and its "
                            "control always run (default: the drafters benchmarked by default)")
    bench.add_argument("--per-category", type=int, default=None, help="prompts per category (HumanEval: in all)")
    bench.add_argument("--max-tokens", type=int, default=None)
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--all-turns", action="store_true", help="Spec-Bench: every turn, not just the first")
    bench.add_argument("--max-model-len", type=int, default=None,
                       help="context length (default: 4096, or the model's if fewer)")
    bench.add_argument("--peers", choices=["hf", "llama.cpp"], default=None,
                       help="speculative: hf, Hugging Face transformers on the same GGUF weights; gpu: hf, its "
                            "eager forward beside the step; kernels: llama.cpp, its llama-bench and "
                            "llama-speculative-simple on the same GGUF files (built into the cache once)")
    bench.add_argument("--levels", default=None,
                       help="concurrency: requests in flight (default 1,2,4,8,16); server-load: clients (1,4,16)")
    bench.add_argument("--requests", type=int, default=16, help="concurrency, server-load: requests per level")
    bench.add_argument("--time-limit", type=float, default=900, help="server-load: seconds per level and config")
    bench.add_argument("--hostile", type=int, default=500, help="abuse: hostile requests beside the ordinary streams")
    bench.add_argument("--fixed-k", type=int, default=3, help="adaptive: the fixed k to compare with")
    bench.add_argument("--formats", default=None,
                       help="plain, quantization: FORMAT, FORMAT:bf16 (activations kept bf16), FORMAT:pytorch, FORMAT:python (decoder layers op by op from Python) or FORMAT:strips (GGUF Q4_K/Q6_K in int4/int8 strips), comma-separated, the first the baseline")
    bench.add_argument("--eval-tokens", type=int, default=1536, help="quantization: tokens of the quality sample")
    bench.add_argument("--device", default=None, help="gpu: cpu, cuda, cuda:N (default: cuda if present)")
    bench.add_argument("--dtype", default=None, help="gpu: float32, bfloat16 (default: bf16 on CUDA)")
    bench.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                       help="gpu: dummy = random weights of the model's shape (config.json + tokenizer suffice)")
    bench.add_argument("--step-mode", default="auto", choices=["auto", "eager", "compile", "graph"],
                       help="gpu: the step under test (auto: CUDA graphs on CUDA)")
    bench.add_argument("--reference", default=None, help="gpu: a reference step script run beside (CUDA)")
    bench.add_argument("--in-process", action="store_true",
                       help="build every config in this process (quicker start; LLMs built one after another "
                            "in one process run a few percent apart)")
    bench.add_argument("--background-load", default=None, metavar="N@FRACTION",
                       help="N busy processes beside the run from that fraction of its prompts to its end "
                            "(2@0.5: two, from halfway): speculation when the machine gets busy")
    bench.add_argument("--output", default="bench-results", help="folder for SUITE.md, SUITE.json and plots")
    bench.add_argument("--write-benchmarks", nargs="?", const="BENCHMARKS.md", default=None, metavar="PATH",
                       help="also write the tables as a section of PATH (default BENCHMARKS.md), headed by "
                            "this command")
    bench.add_argument("--section", default=None,
                       help="that section's name: replaced if present, else appended (default: suite-SUITE)")
    add_option_arguments(bench)
    defaults = {action.dest: action.default for action in bench._actions if action.dest != "help"}
    bench.set_defaults(run=run, flag_defaults=defaults)  # (read by _refuse_unread: what a user did not change)


def run(args: argparse.Namespace) -> None:
    from draftwise.benchmark.configs import config_method
    from draftwise.benchmark.report import write_benchmarks_section, write_outputs
    from draftwise.benchmark.runner import BenchmarkInterrupted
    from draftwise.benchmark.suites import BenchSettings, run_suite

    configs = tuple(c for c in args.configs.split(",") if c) if args.configs else None
    methods = list(dict.fromkeys(config_method(c) for c in configs or () if c != "plain"))  # typos fail here
    if not methods:
        from draftwise.benchmark.configs import default_configs

        methods = default_configs()
    suites_of_peer = {"hf": ("speculative", "gpu"), "llama.cpp": ("kernels",)}
    if args.peers and args.suite not in suites_of_peer[args.peers]:
        raise InvalidParameterError(f"--peers {args.peers} runs beside the "
                                    f"{' and '.join(suites_of_peer[args.peers])} suite(s) only")
    _refuse_unread(args)
    if args.peers and args.temperature:  # (the peers decode greedily: their rows would measure other work)
        raise InvalidParameterError(f"--peers {args.peers} decodes greedily: it runs at --temperature 0 only, "
                                    f"got {args.temperature}")
    if args.suite == "prefix-cache" and args.per_category == 1:
        raise InvalidParameterError("--per-category must be at least 2 for the prefix-cache suite: it times the "
                                    "later requests against the first")
    for name in ("per_category", "max_tokens", "requests", "max_model_len", "fixed_k", "eval_tokens", "hostile"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise InvalidParameterError(f"--{name.replace('_', '-')} must be positive")
    if args.background_load:
        from draftwise.benchmark.background_load import BackgroundLoad

        BackgroundLoad.parse(args.background_load)  # a malformed value fails before any model loads
    settings = BenchSettings(
        output=Path(args.output), model=args.model, datasets=tuple(args.dataset) if args.dataset else None,
        configs=configs, options=drafter_options_from_args(args, methods), per_category=args.per_category,
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed, all_turns=args.all_turns,
        peers=(args.peers,) if args.peers else (), isolation="in-process" if args.in_process else "process",
        max_model_len=args.max_model_len, levels=_levels(args.levels), requests=args.requests,
        fixed_k=args.fixed_k, formats=tuple(f for f in args.formats.split(",") if f) if args.formats else None,
        eval_tokens=args.eval_tokens, time_limit=args.time_limit, hostile=args.hostile, device=args.device,
        dtype=args.dtype, load_format=args.load_format, step_mode=args.step_mode,
        reference=Path(args.reference) if args.reference else None, background_load=args.background_load,
        serve_arguments=speculative_arguments)
    output_folder(settings.output, "--output")  # (before the work: a suite is minutes of measuring)
    if args.write_benchmarks:
        output_file(args.write_benchmarks, "--write-benchmarks")
    try:
        report = run_suite(args.suite, settings)
    except BenchmarkInterrupted as stop:
        _keep_interrupted(stop, args.suite, settings.output)
        raise
    print(report.markdown)
    paths = write_outputs(report, settings.output)
    if args.write_benchmarks:
        command = "draftwise " + shlex.join(getattr(args, "argv", None) or sys.argv[1:])
        write_benchmarks_section(report, Path(args.write_benchmarks), args.section or f"suite-{args.suite}", command)
        paths["benchmarks"] = Path(args.write_benchmarks)
    print(f"\nwritten: {', '.join(str(p) for p in paths.values())}")


def _keep_interrupted(stop, suite: str, folder: Path) -> None:
    """What a run interrupted by Ctrl-C had finished, as it was measured (no tables: a table over
    part of the items would read as the whole), in `<suite>-interrupted.json`."""
    import dataclasses
    import json

    path = folder / f"{suite}-interrupted.json"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"items_finished": stop.done, "items": stop.total,
                                "configs": [dataclasses.asdict(result) for result in stop.results]},
                               indent=1, default=str))
    print(f"\ninterrupted after {stop.done} of {stop.total} items; what they measured is in {path}", file=sys.stderr)


# flag dest -> the setting it sets, where the names differ
_SETTING_OF = {"dataset": "datasets", "in_process": "isolation"}
_NOT_SETTINGS = {"suite", "model", "output", "write_benchmarks", "section", "run", "argv", "flag_defaults"}


def _refuse_unread(args: argparse.Namespace) -> None:
    """A flag the chosen suite does not read is refused by name: it would change nothing, and the
    report would record it as if it had been applied."""
    from draftwise.benchmark.suites import READS
    from draftwise.cli.speculative_flags import given_options, option_flags

    option_dests = {flag.dest for flag in option_flags()}
    parser_defaults = args.flag_defaults
    given = [dest for dest, value in vars(args).items()
             if dest not in _NOT_SETTINGS and dest not in option_dests and dest in parser_defaults
             and value != parser_defaults[dest]]
    unread = ["--" + dest.replace("_", "-") for dest in given if _SETTING_OF.get(dest, dest) not in READS[args.suite]]
    if given_options(args) and "options" not in READS[args.suite]:
        unread += [flag.flag for flag in option_flags() if getattr(args, flag.dest, None) is not None]
    if unread:
        flags = ", ".join(unread)
        raise InvalidParameterError(f"{flags}: not read by the {args.suite} suite (it would change nothing)")


def _levels(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        levels = tuple(int(c) for c in text.split(",") if c)
    except ValueError:
        raise InvalidParameterError(f"--levels must be comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise InvalidParameterError(f"--levels must be positive, got {text!r}")
    return levels
