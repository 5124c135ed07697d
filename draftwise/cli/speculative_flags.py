"""Command-line flags for speculation, read from the drafter registry: `--method`, the options every
drafter shares, and each drafter's own options (one flag per option name; a flag given for a method
that does not take it is an error, never ignored)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from draftwise.errors import InvalidParameterError
from draftwise.speculative.registry import all_specs, names

DEFAULT_K = 5  # -k when not given


@dataclasses.dataclass(frozen=True, slots=True)
class OptionFlag:
    flag: str  # "--draft"
    dest: str  # the argparse attribute
    name: str  # the option's field name
    zero_is_none: bool


def option_flags() -> list[OptionFlag]:
    """One flag per option name across all drafters (drafters sharing an option share its flag)."""
    flags: dict[str, OptionFlag] = {}
    for spec in all_specs():
        for field in dataclasses.fields(spec.options):
            flag = field.metadata.get("flag") or "--" + field.name.replace("_", "-")
            flags.setdefault(field.name, OptionFlag(flag, "option_" + field.name, field.name,
                                                    bool(field.metadata.get("zero_is_none"))))
    return list(flags.values())


def add_option_arguments(command: argparse.ArgumentParser) -> None:
    """Every drafter option as a flag (default: the drafter's own default)."""
    for spec in all_specs():
        hints = typing.get_type_hints(spec.options)
        for field in dataclasses.fields(spec.options):
            flag = next(f for f in option_flags() if f.name == field.name)
            if any(action.dest == flag.dest for action in command._actions):
                continue
            takers = [s.name for s in all_specs() if field.name in {f.name for f in dataclasses.fields(s.options)}]
            command.add_argument(flag.flag, dest=flag.dest, type=_flag_type(hints[field.name]), default=None,
                                 metavar=field.name.upper(),
                                 help=f"{field.metadata.get('help', '')} [{', '.join(takers)}]")


def add_speculative_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("--method", choices=names(), default=None,
                         help="speculate with: " + "; ".join(f"{s.name}: {s.summary}" for s in all_specs()))
    command.add_argument("-k", "--num-speculative-tokens", type=int, default=None,
                         help=f"most tokens drafted per step (exactly this many with --fixed-k; default {DEFAULT_K})")
    command.add_argument("--fixed-k", action="store_true", help="always draft k tokens (default: adaptive k)")
    command.add_argument("--draft-probability", type=float, default=None,
                         help="randomized drafting: draft with this probability per step (default 1)")
    add_option_arguments(command)


def given_options(args: argparse.Namespace) -> dict[str, object]:
    """Option name -> value of every drafter option flag the user gave."""
    given = {}
    for flag in option_flags():
        value = getattr(args, flag.dest, None)
        if value is not None:
            given[flag.name] = None if flag.zero_is_none and value == 0 else value
    return given


def speculative_from_args(args: argparse.Namespace, per_request: list[str] = ()) -> dict | None:
    """The `speculative` dict for `--method` and the flags given (None without --method). Drafter
    options that one of the `per_request` methods takes (the server's) need no --method."""
    given = given_options(args)
    elsewhere = {name for method in per_request for name in options_for(method, given, strict=False)}
    if not args.method:
        shared = [flag for flag, value in (("-k", args.num_speculative_tokens), ("--fixed-k", args.fixed_k or None),
                                           ("--draft-probability", args.draft_probability)) if value is not None]
        alone = set(given) - elsewhere
        if alone or shared:
            raise InvalidParameterError(f"{', '.join(shared + ([_flags(alone)] if alone else []))} need --method")
        return None
    options_for(args.method, {name: given[name] for name in set(given) - elsewhere}, strict=True)
    return {"method": args.method, "num_speculative_tokens": num_speculative_tokens(args),
            "adaptive": not args.fixed_k,
            "draft_probability": 1.0 if args.draft_probability is None else args.draft_probability,
            **options_for(args.method, given, strict=False)}


def num_speculative_tokens(args: argparse.Namespace) -> int:
    """-k as given, else its default."""
    return DEFAULT_K if args.num_speculative_tokens is None else args.num_speculative_tokens


def speculative_arguments(spec: dict | None) -> list[str]:
    """The flags that `speculative_from_args` reads back as `spec` (a flat speculative dict; None: no
    flags, plain decoding). An option set to None is written as 0 where 0 means None, and left out
    (its default) otherwise."""
    if spec is None:
        return []
    rest = dict(spec)
    argv = ["--method", rest.pop("method"), "-k", str(rest.pop("num_speculative_tokens", 5)),
            "--draft-probability", str(rest.pop("draft_probability", 1.0))]
    if not rest.pop("adaptive", True):
        argv.append("--fixed-k")
    flags = {flag.name: flag for flag in option_flags()}
    for name, value in rest.items():
        if name not in flags:
            raise InvalidParameterError(f"no command-line flag for speculative option {name!r}")
        if value is not None or flags[name].zero_is_none:
            argv += [flags[name].flag, str(0 if value is None else value)]
    return argv


def drafter_options_from_args(args: argparse.Namespace, methods: list[str]) -> dict[str, dict]:
    """For commands over several drafters (bench, plan): each given option goes to every listed
    drafter that takes it; an option none of them takes is an error."""
    given = given_options(args)
    per_method = {method: options_for(method, given, strict=False) for method in methods}
    unused = set(given) - {name for options in per_method.values() for name in options}
    if unused:
        raise InvalidParameterError(f"{_flags(unused)} apply to none of the drafters {methods}")
    return per_method


def options_for(method: str, given: dict[str, object], strict: bool) -> dict[str, object]:
    spec = next(s for s in all_specs() if s.name == method)
    fields = {f.name for f in dataclasses.fields(spec.options)}
    if strict and set(given) - fields:
        raise InvalidParameterError(f"{_flags(set(given) - fields)} do not apply to --method {method}")
    return {name: value for name, value in given.items() if name in fields}


def _flags(names_: object) -> str:
    by_name = {f.name: f.flag for f in option_flags()}
    return ", ".join(sorted(by_name[name] for name in names_))


def _flag_type(hint):
    """int for `int | None`, and so on; a bool option reads true/false (argparse's `bool` would take
    any non-empty text, "false" included, as True)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return _boolean if hint is bool else hint


def _boolean(text: str) -> bool:
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    if text.lower() not in words:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return words[text.lower()]
