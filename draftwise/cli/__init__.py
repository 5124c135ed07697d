"""Command line: `draftwise generate | profile | serve | bench | plan | models | divergence | train-head`, one module
per command."""

from __future__ import annotations

import argparse
import os
import sys

from draftwise.errors import DraftwiseError


def build_parser() -> argparse.ArgumentParser:
    from draftwise.cli import bench, divergence, generate, models, plan, profile, serve, train_head

    parser = argparse.ArgumentParser(prog="draftwise", description="Lossless speculative decoding for LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in (generate, profile, serve, bench, plan, models, divergence, train_head):
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)  # (imports torch: a Ctrl-C may land here too)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # `bench --write-benchmarks` quotes the command
        args.run(args)
    except DraftwiseError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say, and no one to say it to
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python flushes stdout at exit)
        return 141  # (128 + SIGPIPE, as a shell reports a command a closed pipe stopped)
    return 0
