"""`draftwise plan`: from your traffic, will speculation pay at your concurrency, and what does it save?"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftwise.output_paths import output_folder
from draftwise.cli.speculative_flags import add_option_arguments, drafter_options_from_args
from draftwise.errors import InvalidParameterError
from draftwise.loading.registry import DEFAULT_TARGET


DEFAULT_CONCURRENCY = "1,4,16,64"


def add_parser(commands) -> None:
    from draftwise.speculative.registry import all_specs

    defaults = ",".join(spec.name for spec in all_specs() if spec.benchmark_by_default)
    plan = commands.add_parser("plan", help="predict, from your traffic, whether speculation pays at your concurrency")
    plan.add_argument("--traffic", default=None, help="JSONL: one request per line (prompt, messages or turns)")
    plan.add_argument("--from-plan", default=None, metavar="PLAN_JSON",
                      help="predict a saved plan again with --costs (measured on another device): no traffic run")
    plan.add_argument("--costs", default=None, metavar="DIR",
                      help="with --from-plan: cost models written by `draftwise bench --suite gpu` (<output>/costs)")
    plan.add_argument("--model", default=DEFAULT_TARGET)
    plan.add_argument("--drafters", default=defaults, help="comma-separated registered drafters, each "
                      "with options if wanted (draft:model=smollm2-135m:cross_tokenizer=true beside draft weighs two "
                      "draft models)")
    plan.add_argument("--concurrency", default=DEFAULT_CONCURRENCY, help="comma-separated levels to predict")
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
    plan.add_argument("--validate-rounds", type=int, default=3,
                      help="rounds of plain then each drafter at each level; a row is the median of its rounds")
    plan.add_argument("--replicas", default=None, help="comma-separated replica counts to weigh (serve --replicas): "
                      "the plan then runs at --threads-per-replica and sums replicas")
    plan.add_argument("--threads-per-replica", type=int, default=1)
    plan.add_argument("--target-qps", type=float, default=None, help="with --replicas: requests per second to serve")
    plan.add_argument("--slo-p95", type=float, default=None, help="with --replicas: the p95 latency allowed, seconds")
    plan.add_argument("--output", default="plan", help="folder for plan.md, plan.json and plan.png")
    add_option_arguments(plan)
    plan.set_defaults(run=run)


def levels(text: str, flag: str = "--concurrency") -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise InvalidParameterError(f"{flag} must list positive integers, got {text!r}")
    return values


def run(args: argparse.Namespace) -> None:
    from draftwise.planner.make import make_plan
    from draftwise.planner.plan import PlanOptions, drafter_method
    from draftwise.planner.report import render, write
    from draftwise.speculative.registry import drafter_spec

    if args.from_plan or args.costs:
        return run_on_device(args)
    if not args.traffic:
        raise InvalidParameterError("--traffic is required (or --from-plan with --costs)")
    output_folder(args.output, "--output")  # (before the work: a plan is minutes of measuring)
    drafters = tuple(d for d in args.drafters.split(",") if d)
    if not drafters:
        raise InvalidParameterError("--drafters must name at least one drafter")
    if min(args.max_k, args.sample, args.max_tokens, args.validate_rounds) < 1:
        raise InvalidParameterError("--max-k, --sample, --max-tokens and --validate-rounds must be positive")
    for entry in drafters:
        drafter_spec(drafter_method(entry))  # an unknown name fails before any model loads (its options in PlanOptions)
    by_method = drafter_options_from_args(args, sorted({drafter_method(entry) for entry in drafters}))
    options = PlanOptions(args.traffic, args.model, drafters, {e: by_method[drafter_method(e)] for e in drafters},
                          levels(args.concurrency), args.sample, args.max_tokens, args.max_k, args.segment_field,
                          args.price_per_mtok, args.tokens_per_day, args.seed, args.validate,
                          args.validate_max_concurrency, args.validate_rounds,
                          levels(args.replicas, "--replicas") if args.replicas else (), args.threads_per_replica,
                          args.target_qps, args.slo_p95)
    plan = make_plan(options, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(render(plan))
    paths = write(plan, Path(args.output))
    print(f"\nwritten: {', '.join(str(p) for p in paths.values())}")


def run_on_device(args: argparse.Namespace) -> None:
    import json
    from dataclasses import asdict

    from draftwise.planner.on_device import predict_on_device, render_device_prediction

    if not (args.from_plan and args.costs):
        raise InvalidParameterError("--from-plan and --costs go together")
    ignored = _given_besides(args, {"from_plan", "costs", "concurrency", "output"})
    if ignored:
        raise InvalidParameterError(f"--from-plan predicts the saved plan's traffic, drafters and options again: "
                                    f"{', '.join(ignored)} do not apply (--concurrency and --output do)")
    concurrency = levels(args.concurrency) if args.concurrency != DEFAULT_CONCURRENCY else None
    prediction = predict_on_device(Path(args.from_plan), Path(args.costs), concurrency)
    text = render_device_prediction(prediction)
    folder = Path(args.output)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "device-plan.json").write_text(json.dumps(asdict(prediction), indent=1, default=str))
    (folder / "device-plan.md").write_text(text + "\n")
    print(text)
    print(f"\nwritten: {folder / 'device-plan.json'}, {folder / 'device-plan.md'}")


def _given_besides(args: argparse.Namespace, allowed: set[str]) -> list[str]:
    """The flags given a value other than their default, except `allowed` (by their names)."""
    from draftwise.cli import build_parser
    from draftwise.cli.speculative_flags import option_flags

    defaults = vars(build_parser().parse_args(["plan"]))
    flags = {flag.dest: flag.flag for flag in option_flags()}
    return sorted(flags.get(dest, "--" + dest.replace("_", "-")) for dest, value in vars(args).items()
                  if dest in defaults and dest not in allowed and dest != "run" and value != defaults[dest])
