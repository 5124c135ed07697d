"""`draftwise profile`: the measured cost model speculation plans with, and the k it implies."""

from __future__ import annotations

import argparse

from draftwise.cli.model_flags import add_model_arguments, model_keywords
from draftwise.cli.speculative_flags import speculative_from_args

ACCEPTANCE_RATES = (0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def add_parser(commands) -> None:
    profile = commands.add_parser("profile", help="measure (or show the cached) costs speculation is planned with")
    add_model_arguments(profile)
    profile.add_argument("--refresh", action="store_true", help="measure again even if a cached profile exists")
    profile.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from draftwise.llm import LLM
    from draftwise.speculative.control.controller import best_num_tokens, expected_tokens

    speculative = speculative_from_args(args)
    llm = LLM(args.model, max_num_seqs=1, **model_keywords(args))
    if speculative is not None:
        llm.set_speculative({**speculative, "adaptive": False})  # measured below, with --refresh honoured
    proposer = llm.engine.drafters[llm.default_method].proposer if llm.default_method else None
    costs = llm.measure_costs(proposer, llm.speculative, refresh=args.refresh)
    print(f"cost model: {costs.key}\n")
    print(costs.table())
    if speculative is None:
        return
    k_max = args.num_speculative_tokens
    plain = costs.step_seconds(0)
    print(f"\nBest k per acceptance rate (constant over positions; k <= {k_max}):\n")
    print("| acceptance | best k | tokens/step | speedup over plain |\n|---|---|---|---|")
    for rate in ACCEPTANCE_RATES:
        rates = [rate] * k_max
        k = best_num_tokens(rates, costs, k_max)
        tokens = expected_tokens(rates, k)
        print(f"| {rate:.2f} | {k} | {tokens:.2f} | {tokens / costs.step_seconds(k) * plain:.2f}x |")
