"""The house rules, checked on the code itself: packages import only downward through the layers,
no two packages import each other (directly or around a cycle), and no module outside a drafter's
own names a drafter (they all read the registry)."""

from __future__ import annotations

import ast
from pathlib import Path

import draftwise
from draftwise.speculative.registry import names

ROOT = Path(draftwise.__file__).parent

# Bottom to top; a package may import packages of lower layers only.
LAYERS = [
    {"errors"},
    {"paths", "stats", "plots"},
    {"native"},
    {"sampling", "text", "traffic", "output_paths"},
    {"structured"},
    {"model"},
    {"quant"},
    {"loading"},
    {"cache"},
    {"runner"},
    {"speculative"},
    {"engine"},
    {"llm"},
    {"server", "benchmark", "planner", "training"},
    {"scaleout"},
    {"cli"},
    {"__init__", "__main__"},
]
RANK = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}


def package_of(path: Path) -> str:
    return path.relative_to(ROOT).parts[0].removesuffix(".py")


def imported_modules(tree: ast.AST) -> set[str]:
    """Every draftwise module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("draftwise"):
            submodules = {f"{node.module}.{alias.name}" for alias in node.names}
            is_module = [(ROOT.parent / (name.replace(".", "/") + ".py")).exists() for name in submodules]
            found.update(submodules if all(is_module) else {node.module})
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("draftwise"))
    return found


def package_imports() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the files that import across."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in ROOT.rglob("*.py"):
        source = package_of(path)
        for module in imported_modules(ast.parse(path.read_text())):
            parts = module.split(".")
            target = parts[1] if len(parts) > 1 else "__init__"
            if target != source and (ROOT / target).exists() or (ROOT / f"{target}.py").exists():
                if target != source:
                    edges.setdefault((source, target), []).append(str(path.relative_to(ROOT)))
    return edges


def test_every_package_has_a_layer():
    packages = {package_of(path) for path in ROOT.rglob("*.py")}
    assert packages <= set(RANK), f"give these packages a layer in this test: {sorted(packages - set(RANK))}"


def test_packages_import_only_downward():
    upward = {f"{a} -> {b}": files for (a, b), files in package_imports().items() if RANK[a] <= RANK[b]}
    assert not upward, f"imports that do not go down a layer: {upward}"


def test_no_import_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for a, b in package_imports():
        graph.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and (seen.add(nxt) or reaches(nxt, goal, seen))):
                return True
        return False

    cycles = sorted(package for package in graph if reaches(package, package, set()))
    assert not cycles, f"packages on an import cycle: {cycles}"


def string_constants(tree: ast.AST) -> list[tuple[int, str]]:
    """String constants in code, docstrings left out."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


NOT_DRAFTER_NAMES = {
    ("speculative/control/cost_model.py", "draft"),  # the JSON key of its table of drafting costs
    ("server/requests.py", "suffix"),  # the OpenAI completions field (fill-in-the-middle)
    ("server/handler.py", "suffix"),  # the same field, named in its error
    ("benchmark/hostile_requests.py", "suffix"),  # the same field, sent by the hostile client
    ("speculative/heads/eagle_format.py", "eagle"),  # speculators' model type for EAGLE-1 (a file format's field)
    ("speculative/heads/eagle3_format.py", "eagle3"),  # speculators' model type and algorithm for EAGLE-3
}


def test_no_module_names_a_drafter_outside_its_own():
    drafters = set(names())
    assert {"draft", "ngram", "layer_skip"} <= drafters  # the test has something to look for
    own = ROOT / "speculative" / "drafters"
    named = []
    for path in ROOT.rglob("*.py"):
        if path.parent == own:
            continue
        relative = str(path.relative_to(ROOT))
        for line, text in string_constants(ast.parse(path.read_text())):
            # a name as code uses it: "ngram", or in a list or config string: "draft,ngram", "ngram:k=2"
            items = {item.split(":")[0] for item in text.split(",")} if " " not in text.strip() else set()
            if items & drafters and (relative, text) not in NOT_DRAFTER_NAMES:
                named.append(f"{relative}:{line}: {text!r}")
        if path.parent != own and "speculative.drafters." in path.read_text():
            named.append(f"{path.relative_to(ROOT)} imports a drafter module")
    assert not named, "drafters named outside their module:\n" + "\n".join(named)


def test_a_drafter_registered_in_one_module_is_offered_everywhere(tiny_qwen, monkeypatch):
    """A new drafter is one registration: the LLM builds it (with its own profiler), the CLI grows
    its flag, the benchmark's config syntax and the server's per-request field accept it."""
    from dataclasses import dataclass

    from draftwise import LLM, SamplingParams
    from draftwise.benchmark.configs import parse_config
    from draftwise.cli import build_parser
    from draftwise.speculative import registry
    from draftwise.speculative.control.cost_model import CostModel
    from draftwise.speculative.drafters.ngram import NgramProposer

    @dataclass
    class EchoOptions:
        echo_span: int = registry.option(2, "tokens to echo")

    profiled = []

    def profile(runner, proposer, tokenizer, max_k):
        profiled.append(max_k)
        return CostModel({n: 0.01 * (1 + 0.1 * n) for n in (1, 2, 4, 8, 16, 32, 64)}, {k: 0.001 for k in (1, 2, 3)})

    spec = registry.DrafterSpec("echo", "repeats what it saw", EchoOptions,
                                lambda target, options: NgramProposer(1, options.echo_span), profile=profile)
    monkeypatch.setitem(registry._REGISTRY, "echo", spec)
    llm = LLM(str(tiny_qwen), max_model_len=128, progress=False,
              speculative={"method": "echo", "echo_span": 3, "num_speculative_tokens": 3})
    assert profiled == [3] and llm.cost_model.draft[1] == 0.001
    out = llm.generate("x = 1\nx = 1\nx = 1\nx =", SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.metrics.spec.num_drafts + out.metrics.spec.num_plain_steps > 0
    args = build_parser().parse_args(["generate", "--method", "echo", "--echo-span", "5", "hi"])
    assert args.method == "echo" and args.option_echo_span == 5
    assert parse_config("echo:k=2", {"echo": {"echo_span": 4}})["echo_span"] == 4
