"""`draftwise profile`: the measured cost model speculation plans with, and the k it implies."""

from __future__ import annotations

import argparse

from draftwise.cli.model_flags import add_model_arguments, model_keywords
from draftwise.cli.speculative_flags import num_speculative_tokens, speculative_from_args

ACCEPTANCE_RATES = (0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def add_parser(commands) -> None:
    profile = commands.add_parser("profile", help="measure (or show the cached) costs speculation is planned with")
    add_model_arguments(profile)
    profile.add_argument("--refresh", action="store_true", help="measure again even if a cached profile exists")
    profile.add_argument("--live", type=int, default=0, metavar="TOKENS",
                         help="then generate TOKENS tokens and show the costs learned from those steps beside the "
                              "profile's (what the adaptive controller plans with while serving)")
    profile.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from draftwise.llm import LLM
    from draftwise.speculative.control.controller import best_num_tokens, expected_tokens

    from draftwise.errors import InvalidParameterError

    if args.live < 0:
        raise InvalidParameterError(f"--live must be a number of tokens >= 0, got {args.live}")
    ignored = [flag for flag, given in (("--fixed-k", args.fixed_k),
                                         ("--draft-probability", args.draft_probability is not None))
               if given]
    if ignored:  # (the profile times the drafter at every k up to -k; neither changes what it measures)
        raise InvalidParameterError(f"{', '.join(ignored)}: not read by profile (it measures every k up to -k)")
    speculative = speculative_from_args(args)
    llm = LLM(args.model, max_num_seqs=1, **model_keywords(args))
    if speculative is not None:
        llm.set_speculative({**speculative, "adaptive": False})  # measured below, with --refresh honoured
    proposer = llm.engine.drafters[llm.default_method].proposer if llm.default_method else None
    costs = llm.measure_costs(proposer, llm.speculative, refresh=args.refresh)
    print(f"cost model: {costs.key}\n")
    print(costs.table())
    if args.live:
        print(live_table(llm, costs, args.live))
    if speculative is None:
        return
    k_max = num_speculative_tokens(args)
    plain = costs.step_seconds(0)
    print(f"\nBest k per acceptance rate (constant over positions; k <= {k_max}):\n")
    print("| acceptance | best k | tokens/step | speedup over plain |\n|---|---|---|---|")
    for rate in ACCEPTANCE_RATES:
        rates = [rate] * k_max
        k = best_num_tokens(rates, costs, k_max)
        tokens = expected_tokens(rates, k)
        print(f"| {rate:.2f} | {k} | {tokens:.2f} | {tokens / costs.step_seconds(k) * plain:.2f}x |")


def live_table(llm, prior, num_tokens: int) -> str:
    """Generate `num_tokens` tokens (greedy, EOS ignored) feeding a live cost model with every step,
    and show prior and live costs side by side."""
    from draftwise.sampling.params import SamplingParams
    from draftwise.speculative.control.live_costs import LiveCostModel
    from draftwise.speculative.control.profile import _SAMPLE_TEXT

    live = LiveCostModel(prior)
    with llm.listening(live.observe_step):
        output = llm.generate(_SAMPLE_TEXT, SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True))[0]
    summary = live.summary()
    generated = len(output.token_ids)
    context = " (the context held no more than that)" if generated < num_tokens else ""
    lines = [f"\nLive costs after {generated} generated tokens{context} (the profile is their prior; points "
             f"without samples of their own move with the median ratio of all):\n",
             "| n | profile ms | live ms | live / profile | samples |", "|---|---|---|---|---|"]
    for n, row in summary["target"].items():
        lines.append(f"| {n} | {row['prior'] * 1e3:.1f} | {row['live'] * 1e3:.1f} | {row['live'] / row['prior']:.2f} "
                     f"| {row['samples']} |")
    if summary["drafter"]:
        lines += ["", "| k | drafter profile ms | live ms |", "|---|---|---|"]
        lines += [f"| {k} | {row['prior'] * 1e3:.1f} | {row['live'] * 1e3:.1f} |" for k, row in summary["drafter"].items()]
        catch_up = summary["catch_up_per_token"]
        lines.append(f"\nCatch-up per backlog token: profile {catch_up['prior'] * 1e3:.2f} ms, live "
                     f"{catch_up['live'] * 1e3:.2f} ms ({catch_up['samples']} catch-ups timed).")
    if live.prior_dropped:
        lines.append("\nThe profile is far from the live plain step: it has been dropped from the cache.")
    return "\n".join(lines)
