"""`--suite abuse`: a server that serves ordinary clients while a hostile one throws everything at it.

One `draftwise serve` (plain decoding, or the first config given) on loopback, answering loopback
Host names only. Phase quiet: c ordinary clients (`--levels`, default 64) stream max(`--requests`,
c) completions, greedy; their texts are the reference and their throughput the control.
Phase abuse: the same streams again while `--hostile` requests (default 500) from the catalogue in
`hostile_requests.py`, in turn, go out 50 at a time, and /health is probed every 50 ms. Reported:
what was held (ordinary streams finished, complete, with the quiet phase's text; hostile requests
answered with their 4xx and an OpenAI error body; /health's latency) and what was lost (ordinary
streams failed, cut or changed; hostile requests answered wrongly, by kind).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from contextlib import ExitStack

from draftwise.benchmark.configs import parse_config
from draftwise.benchmark.hostile_requests import catalogue
from draftwise.benchmark.loadgen import Server, drive
from draftwise.benchmark.report import SuiteReport, ratio, table
from draftwise.benchmark.suites import BenchSettings
from draftwise.benchmark.suites.speculative import prompts_for
from draftwise.benchmark.summary import speedup
from draftwise.stats import percentile

CLIENTS = 64
MAX_REQUEST_BYTES = 8 * 2**20  # the server's body limit here (its default), which hostile bodies pass
BURST_CONCURRENCY = 50
HEALTH_INTERVAL = 0.05


HEALTH_PROBE = """
import select, sys, time, urllib.request
latencies = []
while not select.select([sys.stdin], [], [], 0)[0]:  # until the parent writes a line
    started = time.perf_counter()
    with urllib.request.urlopen(sys.argv[1] + "/health", timeout=30) as response:
        latencies.append((time.perf_counter() - started, response.status))
    time.sleep(float(sys.argv[2]))
print(repr(latencies))
"""


class HealthProbe:
    """/health probed every HEALTH_INTERVAL from a process of its own (so that what it measures is
    the server, not this process's event loop, busy sending the burst)."""

    def __init__(self, base: str) -> None:
        import subprocess
        import sys

        self.process = subprocess.Popen([sys.executable, "-c", HEALTH_PROBE, base, str(HEALTH_INTERVAL)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def stop(self) -> list[tuple[float, int]]:
        import ast

        out, _ = self.process.communicate(input="stop\n", timeout=120)
        return ast.literal_eval(out.strip() or "[]")


class HostileBurst:
    """`count` hostile requests, the catalogue in turn, `BURST_CONCURRENCY` at a time; /health probed
    all along. Side traffic for `loadgen.drive`."""

    name = "hostile"

    def __init__(self, base: str, model: str, count: int) -> None:
        self.base, self.count = base, count
        self.requests = catalogue(model, MAX_REQUEST_BYTES)

    async def run(self, client, model: str, done: asyncio.Event) -> dict:
        import httpx

        answered, wrong, self.problems = Counter(), Counter(), []
        probe = HealthProbe(self.base)
        async with httpx.AsyncClient(base_url=self.base, timeout=120) as http:
            async def send(index: int) -> None:
                request = self.requests[index % len(self.requests)]
                problems = request.problems(await request.send_async(http))
                answered[request.name] += 1
                if problems:
                    wrong[request.name] += 1
                    self.problems += problems

            for start in range(0, self.count, BURST_CONCURRENCY):
                await asyncio.gather(*(send(i) for i in range(start, min(start + BURST_CONCURRENCY, self.count))))
        health = probe.stop()
        seconds = sorted(s for s, _ in health)
        return {"sent": self.count, "answered_right": self.count - sum(wrong.values()), "wrong": dict(wrong),
                "kinds": len(self.requests), "health_probes": len(health),
                "health_not_200": sum(status != 200 for _, status in health), "problems": self.problems[:10],
                "health_p50": percentile(seconds, 0.5), "health_p99": percentile(seconds, 0.99),
                "health_max": seconds[-1] if seconds else None}


def run(settings: BenchSettings) -> SuiteReport:
    clients = (settings.levels or (CLIENTS,))[0]
    max_tokens = settings.max_tokens or 32
    count = max(settings.requests, clients)  # every client streams at least once
    available = prompts_for(settings, 2, max_tokens)
    prompts = [available[i % len(available)] for i in range(count)]
    configs = list(settings.configs or ())
    spec = parse_config(configs[0], settings.options) if configs else None
    with ExitStack() as stack:
        server = Server(["--model", settings.model, "--max-num-seqs", "8", "--max-model-len",
                         str(settings.max_model_len), "--allowed-hosts", "127.0.0.1,localhost",
                         "--max-request-bytes", str(MAX_REQUEST_BYTES),
                         *settings.serve_arguments(spec)], settings.output / "server-abuse.log")
        stack.callback(server.stop)
        server.wait_ready()
        quiet = asyncio.run(drive(server.base, server.model, prompts, clients, max_tokens, settings.time_limit))
        burst = HostileBurst(server.base, server.model, settings.hostile)
        abused = asyncio.run(drive(server.base, server.model, prompts, clients, max_tokens, settings.time_limit,
                                   side=(burst,)))
    hostile = abused["side"]["hostile"]
    same = sum(quiet["texts"].get(i) == text for i, text in abused["texts"].items())
    held = [["ordinary streams finished", f"{abused['finished']}/{abused['requests']}"],
            ["ordinary streams complete (a finish_reason, [DONE])", f"{abused['finished'] - abused['incomplete']}"],
            ["ordinary texts equal to the quiet phase's", f"{same}/{abused['finished']}"],
            ["hostile requests answered as they must", f"{hostile['answered_right']}/{hostile['sent']} "
             f"({hostile['kinds']} kinds)"],
            ["/health p50 / p99 / max ms", f"{hostile['health_p50'] * 1e3:.0f} / {hostile['health_p99'] * 1e3:.0f} / "
             f"{hostile['health_max'] * 1e3:.0f} ({hostile['health_probes']} probes, "
             f"{hostile['health_not_200']} not 200)"],
            ["ordinary throughput under abuse vs quiet", ratio(speedup(abused["tokens"], abused["seconds"],
                                                                       quiet["tokens"], quiet["seconds"]))]]
    lost = [["ordinary streams failed (errors)", len(abused["errors"])],
            ["ordinary streams cut (incomplete)", abused["incomplete"]],
            ["ordinary texts changed", abused["finished"] - same],
            ["hostile requests answered wrongly", sum(hostile["wrong"].values())]]
    lost += [[f"  of which {name}", count] for name, count in sorted(hostile["wrong"].items())]
    config = configs[0] if configs else "plain"
    text = "\n\n".join([
        f"`draftwise serve --model {settings.model}` ({config}), loopback: {clients} ordinary streaming clients, "
        f"{len(prompts)} greedy completions of up to {max_tokens} tokens, first quiet, then beside a burst of "
        f"{hostile['sent']} hostile requests ({BURST_CONCURRENCY} at a time) and /health probed every "
        f"{HEALTH_INTERVAL * 1000:.0f} ms. The quiet phase is the control.",
        "What was held:", table(["", ""], held), "What was lost:", table(["", ""], lost)])
    return SuiteReport("abuse", text, {"quiet": _without_texts(quiet), "abused": _without_texts(abused)})


def _without_texts(result: dict) -> dict:
    return {name: value for name, value in result.items() if name != "texts"}
