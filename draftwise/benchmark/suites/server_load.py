"""`--suite server-load`: real `draftwise serve` processes driven by the official `openai` client.

Each config gets its own server (plain decoding: no `--method`; a drafter: `--method` and its flags;
the control: a second plain server) on loopback, each its own process as the runner's workers are;
a server that measures a cost model as it starts (an adaptive drafter) starts alone. At each client
count c, c clients in a closed loop stream one completion after another until `--requests` have
finished (never past `--time-limit` seconds per level and config); level by level, the configs in
turn, the first rotating (`runner.run_benchmark`). Prompts: Spec-Bench first turns (2 per category)
and HumanEval, greedy, each request carrying its category as its `segment`. Per config and client
count: generated tokens per second over the level's wall time and its speedup over plain
(`summary.speedup`), TTFT p50 / p95, latency p50 / p95, the mean and p95 gap between streamed
chunks, and requests finished, failed, incomplete, and with a text different from plain's (greedy:
there must be none). `loadgen.SideTraffic` is where hostile requests beside the ordinary streams
plug in (none here).
"""

from __future__ import annotations

from contextlib import ExitStack

from draftwise.benchmark.configs import CONTROL, PLAIN, default_configs, parse_config
from draftwise.benchmark.loadgen import Server, ServerConfig
from draftwise.benchmark.report import SuiteReport, control_line, ratio, table
from draftwise.benchmark.runner import run_benchmark
from draftwise.benchmark.suites import BenchSettings
from draftwise.benchmark.suites.speculative import prompts_for
from draftwise.benchmark.summary import speedup
from draftwise.errors import InvalidParameterError

LEVELS = (1, 4, 16)


def run(settings: BenchSettings) -> SuiteReport:
    if settings.serve_arguments is None:
        raise InvalidParameterError("the server-load suite needs `serve_arguments` (draftwise bench gives it)")
    levels = list(settings.levels or LEVELS)
    max_tokens = settings.max_tokens or 64
    prompts = prompts_for(settings, 2, max_tokens)[:settings.requests]
    named = {PLAIN: None} | {c: parse_config(c, settings.options) for c in settings.configs_or(default_configs())}
    named[CONTROL] = None
    common = ["--model", settings.model, "--max-num-seqs", str(max(levels)), "--max-model-len",
              str(settings.max_model_len)]
    with ExitStack() as stack:
        servers = start_servers(named, common, settings, stack)
        contestants = [ServerConfig(name, servers[name], prompts, max_tokens, settings.time_limit) for name in named]
        results = run_benchmark(contestants, levels, warm_up=prompts[0][1], progress=settings.progress)
    points = {r.name: dict(zip(levels, r.measures)) for r in results}
    for by_level in points.values():
        for c, p in by_level.items():
            base = points[PLAIN][c]
            p["speedup"] = speedup(p["tokens"], p["seconds"], base["tokens"], base["seconds"])
            p["equal_to_plain"] = sum(base["texts"].get(i) == text for i, text in p["texts"].items())
    rows = [[name, c, f"{p['tokens_per_s']:.1f}", ratio(p["speedup"]),
             f"{p['ttft_p50']:.2f} / {p['ttft_p95']:.2f}", f"{p['latency_p50']:.1f} / {p['latency_p95']:.1f}",
             f"{_ms(p['itl_mean'])} / {_ms(p['itl_p95'])}", f"{p['finished']}/{p['requests']}", len(p["errors"]),
             p["incomplete"], f"{p['equal_to_plain']}/{p['finished']}"]
            for name, by_level in points.items() for c, p in by_level.items()]
    control = max((points[CONTROL][c]["speedup"] for c in levels), key=lambda s: abs(s - 1))
    text = "\n\n".join([
        f"`draftwise serve --model {settings.model}`, one server per config on loopback, driven by the official "
        f"`openai` client: {len(prompts)} streaming completions per level, greedy, up to {max_tokens} tokens, "
        "c clients in a closed loop; level by level, the configs in turn (the first rotating).",
        control_line(control, where=" at the client count where it strayed furthest from 1.00x"),
        table(["config", "clients", "tokens/s", "vs plain", "TTFT p50 / p95 s", "latency p50 / p95 s",
               "inter-chunk mean / p95 ms", "finished", "errors", "incomplete", "text = plain"], rows)])
    return SuiteReport("server-load", text, {"levels": levels, "points": points})


def start_servers(named: dict[str, dict | None], common: list[str], settings: BenchSettings,
                  stack: ExitStack) -> dict[str, Server]:
    """A server per config. Those that measure nothing at start-up (plain, a fixed k) start together; a
    server with an adaptive drafter measures this machine's cost model as it starts, so it starts alone."""
    servers: dict[str, Server] = {}

    def start(name: str) -> Server:
        index = list(named).index(name)
        server = Server(common + settings.serve_arguments(named[name]), settings.output / f"server-{index}.log")
        stack.callback(server.stop)
        servers[name] = server
        return server

    quiet = [name for name, spec in named.items() if spec is None or not spec.get("adaptive", True)]
    for server in [start(name) for name in quiet]:
        server.wait_ready()
    for name in (name for name in named if name not in quiet):
        start(name).wait_ready()
    return servers


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"
