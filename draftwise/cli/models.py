"""`draftwise models`: the known models and where the cache keeps them."""

from __future__ import annotations

import argparse


def add_parser(commands) -> None:
    models = commands.add_parser("models", help="list known models and where they are cached")
    models.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from draftwise.loading.registry import DEFAULT_DRAFT, DEFAULT_TARGET, KNOWN_MODELS
    from draftwise.loading.resolve import known_model_file
    from draftwise.paths import CACHE_ENV, cache_root

    print(f"cache: {cache_root()}  (set {CACHE_ENV} to move it)")
    for name, model in KNOWN_MODELS.items():
        role = " [default target]" if name == DEFAULT_TARGET else " [default draft]" if name == DEFAULT_DRAFT else ""
        path = known_model_file(name)
        state = f"assembled at {path}" if path.is_file() else "not fetched yet (fetched on first use)"
        print(f"{name:<22}{model.description}{role}\n{'':<22}{model.size / 2**20:,.0f} MiB, {state}")
