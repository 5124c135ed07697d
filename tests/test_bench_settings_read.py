"""Each bench suite's declared settings (`suites.READS`, what `draftwise bench` refuses outside) are
exactly the settings its code reads: its `run` and, through the calls that pass `settings` on, every
function of the benchmark package it reaches (read from the source, imports resolved)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import draftwise.benchmark as benchmark_package
from draftwise.benchmark.suites import READS, SUITES, BenchSettings

PACKAGE = Path(benchmark_package.__file__).parent
ALWAYS = {"model", "output", "progress", "serve_arguments"}  # read by all, or not from the command line
SETTABLE = {f.name for f in dataclasses.fields(BenchSettings)} - ALWAYS


def _module_name(path: Path) -> str:
    return ".".join(("draftwise", "benchmark", *path.relative_to(PACKAGE).with_suffix("").parts))


def _functions() -> dict[tuple[str, str], tuple[set[str], set[str]]]:
    """(module, function) -> (settings fields it reads, local names it calls with `settings`), and
    (module, name) -> (module, name) where a module imports a name from another."""
    functions, imports = {}, {}
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("draftwise.benchmark"):
                for alias in node.names:
                    imports[(module, alias.asname or alias.name)] = (node.module, alias.name)
            if isinstance(node, ast.FunctionDef) and "settings" in [a.arg for a in node.args.args]:
                reads, calls = set(), set()
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "settings":
                        reads.add("configs" if sub.attr == "configs_or" else sub.attr)
                    if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name):
                        passed = list(sub.args) + [k.value for k in sub.keywords]
                        if any(isinstance(a, ast.Name) and a.id == "settings" for a in passed):
                            calls.add(sub.func.id)
                functions[(module, node.name)] = (reads, calls)
    return functions, imports


def _reads_from(start: tuple[str, str], functions, imports) -> set[str]:
    found, todo, seen = set(), [start], set()
    while todo:
        key = todo.pop()
        key = imports.get(key, key)
        if key in seen or key not in functions:
            continue
        seen.add(key)
        reads, calls = functions[key]
        found |= reads
        todo += [(key[0], name) for name in calls]
    return found


@pytest.mark.parametrize("suite", list(SUITES))
def test_a_suites_declared_settings_are_the_ones_its_code_reads(suite):
    functions, imports = _functions()
    module = f"draftwise.benchmark.suites.{SUITES[suite][0]}"
    assert (module, "run") in functions
    read = _reads_from((module, "run"), functions, imports) & SETTABLE
    assert READS[suite] == read, f"{suite}: declared but not read {READS[suite] - read}, read but not declared {read - READS[suite]}"


def test_every_suite_declares_what_it_reads():
    assert set(READS) == set(SUITES)
    assert all(names <= SETTABLE for names in READS.values())
