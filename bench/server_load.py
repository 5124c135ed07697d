"""Load generator against a real `draftwise serve`: throughput, TTFT and latency, speculation on vs off.

    python bench/server_load.py [--clients 1,4,16] [--requests 16] [--max-tokens 64]

Starts the server (loopback only, default models, `--method draft`: adaptive speculation with the
0.5B draft) and drives it with the official `openai` client: at each client count c, c clients in a
closed loop, each streaming one completion after another until `--requests` have finished (and never
past `--time-limit` seconds per level). The same server serves both configs: speculation on is the
server's default, off is the per-request `"speculative": {"enabled": false}`. Prompts: Spec-Bench
first turns (2 per category, in the chat template) and HumanEval prompts, greedy, each request
carrying its category as its traffic segment. At each client count the two configs run one after the
other, the first alternating between counts.

Reported per config and client count: generated tokens per second over the level's wall time (and
relative to off at the same count), time to first token p50 / p95, request latency p50 / p95, the
inter-token latency of the streams (mean gap between content chunks, p95), and errors, incomplete
responses and outputs that differ from the other config's (greedy: they must not).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import RESULTS, table, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"speculation off": {"enabled": False}, "speculation on": None}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(port: int, max_num_seqs: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "draftwise", "serve", "--method", "draft", "--port", str(port),
               "--max-num-seqs", str(max_num_seqs), "--max-model-len", "2048"]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


async def wait_ready(base: str, server: subprocess.Popen, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"server exited: {server.stderr.read()[-2000:]}")
            try:
                if (await client.get(f"{base}/health", timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1)
    raise RuntimeError("server did not become ready")


async def one_request(client, model: str, prompt: str, max_tokens: int, speculative: dict | None,
                      segment: str | None = None) -> dict:
    """Stream one completion; time to first token, gaps between content chunks, the text."""
    extra = {"speculative": speculative} if speculative is not None else {}
    if segment is not None:
        extra["segment"] = segment
    started = time.perf_counter()
    first, last, gaps, pieces, tokens = None, None, [], [], 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True}, extra_body=extra)
    finish = None
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


async def run_level(base: str, model: str, items: list[tuple[str, str]], clients: int, args, speculative) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=args.time_limit)
    queue = list(enumerate(items))
    results: dict[int, dict] = {}
    errors: list[str] = []
    deadline = time.monotonic() + args.time_limit

    async def worker() -> None:
        while queue and time.monotonic() < deadline:
            index, (segment, prompt) = queue.pop(0)
            try:
                results[index] = await one_request(client, model, prompt, args.max_tokens, speculative, segment)
            except Exception as error:  # counted and reported, never hidden
                errors.append(f"{type(error).__name__}: {error}")

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    seconds = time.perf_counter() - started
    await client.close()
    done = list(results.values())
    ttfts = sorted(r["ttft"] for r in done if r["ttft"] is not None)
    latencies = sorted(r["latency"] for r in done)
    gaps = sorted(g for r in done for g in r["gaps"])
    return {"seconds": seconds, "tokens": sum(r["tokens"] for r in done), "finished": len(done),
            "tokens_per_s": sum(r["tokens"] for r in done) / seconds,
            "ttft_p50": percentile(ttfts, 0.5), "ttft_p95": percentile(ttfts, 0.95),
            "latency_p50": percentile(latencies, 0.5), "latency_p95": percentile(latencies, 0.95),
            "itl_mean": statistics.mean(gaps) if gaps else None, "itl_p95": percentile(gaps, 0.95),
            "incomplete": sum(not r["complete"] for r in done), "errors": errors,
            "texts": {str(i): r["text"] for i, r in results.items()}}


def percentile(values: list[float], q: float) -> float | None:
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def prompts_for(count: int) -> list[tuple[str, str]]:
    """(category, prompt): the concurrency benchmark's prompts (`workload` only needs the tokenizer's
    chat template). Each request carries its category as its traffic segment."""
    from types import SimpleNamespace

    from bench.adaptive import workload
    from draftwise.loading.resolve import resolve_model
    from draftwise.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model("qwen2.5-coder-1.5b", progress=False))
    return workload(SimpleNamespace(tokenizer=tokenizer), 2, 4)[:count]


def report(results: dict, levels: list[int], args) -> str:
    off = results["speculation off"]
    rows = []
    for name, by_level in results.items():
        for c in levels:
            p, base = by_level[str(c)], off[str(c)]
            same = sum(p["texts"].get(i) == t for i, t in base["texts"].items())
            ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
            rows.append([name, c, f"{p['tokens_per_s']:.1f}", f"{p['tokens_per_s'] / base['tokens_per_s']:.2f}x",
                         f"{p['ttft_p50']:.2f} / {p['ttft_p95']:.2f}", f"{p['latency_p50']:.1f} / {p['latency_p95']:.1f}",
                         f"{ms(p['itl_mean'])} / {ms(p['itl_p95'])}",
                         f"{p['finished']}/{args.requests}", len(p["errors"]), p["incomplete"],
                         f"{same}/{len(base['texts'])}"])
    return (f"`draftwise serve --method draft` (default models, adaptive k) on loopback, driven by the official "
            f"`openai` client: {args.requests} streaming completions per level (Spec-Bench 2 per category + "
            f"HumanEval), greedy, up to {args.max_tokens} tokens, c clients in a closed loop. Off = the per-request "
            "`\"speculative\": {\"enabled\": false}` on the same server.\n\n"
            + table(["config", "clients", "tokens/s", "vs off", "TTFT p50 / p95 s", "latency p50 / p95 s",
                     "inter-token mean / p95 ms", "finished", "errors", "incomplete", "text = off"], rows))


async def main_async(args) -> dict:
    levels = [int(c) for c in args.clients.split(",")]
    items = prompts_for(args.requests)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(port, max(levels))
    results: dict = {name: {} for name in CONFIGS}
    try:
        await wait_ready(base, server)
        from openai import AsyncOpenAI

        models = await AsyncOpenAI(base_url=f"{base}/v1", api_key="unused").models.list()
        model = models.data[0].id
        warm = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
        for speculative in CONFIGS.values():  # warm-up: the cost-model profile, the drafter's first call
            await one_request(warm, model, items[0][1], 8, speculative)
        names = list(CONFIGS)
        for i, c in enumerate(levels):  # the config that goes first alternates, so drift falls on both
            for name in names[i % 2:] + names[:i % 2]:
                results[name][str(c)] = await run_level(base, model, items, c, args, CONFIGS[name])
                point = results[name][str(c)]
                print(f"{name} c={c}: {point['tokens_per_s']:.1f} tok/s, TTFT p95 {point['ttft_p95']:.2f} s, "
                      f"errors {len(point['errors'])}", flush=True)
                RESULTS.mkdir(parents=True, exist_ok=True)
                (RESULTS / "server-load-partial.json").write_text(json.dumps(results))
    finally:
        server.terminate()
        server.wait(timeout=60)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--time-limit", type=float, default=900, help="seconds per level and config, at most")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = asyncio.run(main_async(args))
    levels = [int(c) for c in args.clients.split(",")]
    body = report(results, levels, args)
    command = (f"python bench/server_load.py --clients {args.clients} --requests {args.requests} "
               f"--max-tokens {args.max_tokens}")
    write_section("server-load", command, body, {n: {c: {k: v for k, v in p.items() if k != "texts"}
                                                      for c, p in r.items()} for n, r in results.items()})
    print(body)


if __name__ == "__main__":
    main()
