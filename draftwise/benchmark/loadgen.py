"""Load against a real `draftwise serve`: the server as a subprocess, and concurrent streaming clients
(the official `openai` client) in a closed loop.

`drive` runs `clients` ordinary clients, each streaming one completion after another until every
prompt has run once (or the time limit has passed), and reports throughput over the level's wall
time, TTFT, latency, the gaps between streamed chunks, errors and incomplete streams. `side` is other
traffic to send beside them (`SideTraffic`: a later abuse suite's hostile requests): it starts with
the ordinary clients on the same server, is told when they are done, and its results are reported
under its own name, apart from the ordinary streams' figures, which keep their meaning.
`openai` is an optional dependency (the `test` and `bench` extras install it).
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from draftwise.errors import InvalidParameterError
from draftwise.stats import percentile


class SideTraffic(Protocol):
    name: str

    async def run(self, client, model: str, done: asyncio.Event) -> dict:
        """Send requests with `client` (an `openai.AsyncOpenAI`) until `done` is set; what it saw."""


class Server:
    """`draftwise serve ARGS` on a free loopback port; its stderr goes to `log`."""

    def __init__(self, arguments: list[str], log: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as stderr:
            self.process = subprocess.Popen([sys.executable, "-m", "draftwise", "serve", "--host", "127.0.0.1",
                                             "--port", str(self.port), *arguments],
                                            stdout=subprocess.DEVNULL, stderr=stderr)
        self.model = ""

    def wait_ready(self, timeout: float = 900) -> None:
        """Until /health answers (the model loaded, the drafter built); then the served model's name."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"draftwise serve exited ({self.process.returncode}): "
                                   f"{self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError(f"draftwise serve did not become ready in {timeout:.0f} s")
        with urllib.request.urlopen(f"{self.base}/v1/models", timeout=10) as response:
            self.model = json.loads(response.read())["data"][0]["id"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def client_for(base: str, timeout: float):
    try:
        from openai import AsyncOpenAI
    except ImportError:
        raise InvalidParameterError("the server-load suite needs the openai client (pip install openai)") from None
    return AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=timeout)


async def stream_one(client, model: str, prompt: str, max_tokens: int, segment: str | None = None) -> dict:
    """Stream one greedy completion: time to first token, gaps between content chunks, the text."""
    started = time.perf_counter()
    first, last, gaps, pieces, tokens, finish = None, None, [], [], 0, None
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"segment": segment} if segment else None)
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            now = time.perf_counter()
            if choice.text:
                if first is None:
                    first = now - started
                elif last is not None:
                    gaps.append(now - last)
                last = now
                pieces.append(choice.text)
            finish = choice.finish_reason or finish
    return {"ttft": first, "latency": time.perf_counter() - started, "gaps": gaps, "text": "".join(pieces),
            "tokens": tokens, "complete": finish in ("stop", "length")}


async def drive(base: str, model: str, prompts: list[tuple[str, str]], clients: int, max_tokens: int,
                time_limit: float, side: tuple[SideTraffic, ...] = ()) -> dict:
    """`clients` ordinary streaming clients in a closed loop over `prompts` ((segment, prompt) pairs),
    with `side` traffic beside them; the level's figures."""
    client = client_for(base, time_limit)
    queue = list(enumerate(prompts))
    results: dict[int, dict] = {}
    errors: list[str] = []
    deadline = time.monotonic() + time_limit
    done = asyncio.Event()

    async def ordinary() -> None:
        while queue and time.monotonic() < deadline:
            index, (segment, prompt) = queue.pop(0)
            try:
                results[index] = await stream_one(client, model, prompt, max_tokens, segment)
            except Exception as error:  # counted and reported, never hidden
                errors.append(f"{type(error).__name__}: {error}")

    async def ordinary_then_done() -> None:
        await asyncio.gather(*(ordinary() for _ in range(clients)))
        done.set()

    started = time.perf_counter()
    outcome = await asyncio.gather(ordinary_then_done(), *(s.run(client, model, done) for s in side))
    seconds = time.perf_counter() - started
    await client.close()
    finished = list(results.values())
    ttfts = sorted(r["ttft"] for r in finished if r["ttft"] is not None)
    latencies = sorted(r["latency"] for r in finished)
    gaps = sorted(g for r in finished for g in r["gaps"])
    tokens = sum(r["tokens"] for r in finished)
    return {"clients": clients, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "finished": len(finished), "requests": len(prompts),
            "ttft_p50": percentile(ttfts, 0.5), "ttft_p95": percentile(ttfts, 0.95),
            "latency_p50": percentile(latencies, 0.5), "latency_p95": percentile(latencies, 0.95),
            "itl_mean": statistics.mean(gaps) if gaps else None, "itl_p95": percentile(gaps, 0.95),
            "incomplete": sum(not r["complete"] for r in finished), "errors": errors,
            "texts": {i: r["text"] for i, r in sorted(results.items())},
            "side": {s.name: result for s, result in zip(side, outcome[1:])}}


@dataclass(slots=True)
class ServerConfig:
    """A config served by its own `draftwise serve`, as a contestant of the runner: an item is a
    client count, answered with `drive`'s figures."""
    name: str
    server: Server
    prompts: list[tuple[str, str]]
    max_tokens: int
    time_limit: float
    reference: str = "plain"
    side: tuple[SideTraffic, ...] = field(default_factory=tuple)

    def warm_up(self, prompt: str) -> None:
        async def once() -> None:
            client = client_for(self.server.base, self.time_limit)
            await stream_one(client, self.server.model, prompt, 8)
            await client.close()

        asyncio.run(once())

    def run(self, clients: int) -> dict:
        return asyncio.run(drive(self.server.base, self.server.model, self.prompts, clients, self.max_tokens,
                                 self.time_limit, self.side))
