"""`--suite replicas`: `draftwise serve --replicas N` on Ray Serve (a local cluster per server).

Throughput: configs `1x1` (one replica of one thread), `2x1` (two replicas of one thread each) and the
control `1x1 (control)`; per round, each config's server is started alone, warmed up, driven by c
streaming `openai` clients in a closed loop over `--requests` completions (greedy, Spec-Bench and
HumanEval prompts), and stopped; rounds rotate which goes first. Speedups over `1x1` pool the
rounds (`summary.speedup` over summed tokens and seconds).

Affinity: two replicas with `--routing affinity` and with `--routing random`; CONVERSATIONS chats of
TURNS turns each (its own system prompt, the history growing turn by turn), the conversations in
parallel and each one's turns in order. The prefix-cache hit rate over both replicas (prompt tokens
found / looked up, from the merged /metrics) says how much of each turn's prompt its replica already
held.
"""

from __future__ import annotations

import asyncio
import os
import time
import urllib.request

from draftwise.benchmark import cpu_shares
from draftwise.benchmark.loadgen import Server, client_for, drive
from draftwise.benchmark.report import SuiteReport, control_line, ratio, table
from draftwise.benchmark.suites import BenchSettings
from draftwise.benchmark.suites.speculative import prompts_for
from draftwise.benchmark.summary import speedup

CONFIGS = {"1x1": (1, 1), "2x1": (2, 1), "1x1 (control)": (1, 1)}  # name -> (replicas, threads each)
BASELINE = "1x1"
ROUNDS = 2
CLIENTS = 8
CONVERSATIONS, TURNS, TURN_TOKENS = 8, 3, 24
SYSTEM = ("You are a careful senior engineer reviewing code for a team that ships a Python service. "
          "Answer briefly, name the function you mean, and prefer standard-library solutions. ") * 4


def run(settings: BenchSettings) -> SuiteReport:
    clients = (settings.levels or (CLIENTS,))[0]
    max_tokens = settings.max_tokens or 64
    prompts = prompts_for(settings, 2, max_tokens)[:settings.requests]
    common = ["--model", settings.model, "--max-num-seqs", str(clients), "--max-model-len",
              str(settings.max_model_len), "--per-request-methods", ""]  # (plain servers: no drafter built)
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    order = list(CONFIGS)
    for round_index in range(ROUNDS):
        for name in order[round_index % len(order):] + order[:round_index % len(order)]:
            replicas, threads = CONFIGS[name]
            with _server(common + ["--replicas", str(replicas), "--threads-per-replica", str(threads)],
                         settings, f"{name.replace(' ', '-')}-{round_index}") as server:
                _warm_up(server, prompts[0][1])
                before, started = cpu_shares.snapshot(), time.perf_counter()
                runs[name].append(asyncio.run(drive(server.base, server.model, prompts, clients, max_tokens,
                                                    settings.time_limit)))
                runs[name][-1]["cpu"] = cpu_shares.cpu_seconds(before, cpu_shares.snapshot())
                runs[name][-1]["wall"] = time.perf_counter() - started
            if settings.progress:
                print(f"round {round_index + 1}/{ROUNDS}: {name} {runs[name][-1]['tokens_per_s']:.1f} tokens/s",
                      flush=True)
    pooled = {name: _pool(results) for name, results in runs.items()}
    base = pooled[BASELINE]
    for figures in pooled.values():
        figures["speedup"] = speedup(figures["tokens"], figures["seconds"], base["tokens"], base["seconds"])
    affinity = {routing: _conversations(common, settings, routing) for routing in ("affinity", "random")}
    rows = [[name, f"{CONFIGS[name][0]} x {CONFIGS[name][1]}", f"{p['tokens_per_s']:.1f}", ratio(p["speedup"]),
             " / ".join(f"{r['tokens_per_s']:.1f}" for r in runs[name]), f"{p['ttft_p50']:.2f}",
             f"{p['latency_p50']:.1f}", f"{p['finished']}/{p['requests']}", p["errors"]]
            for name, p in pooled.items()]
    roles = sorted({role for results in runs.values() for r in results for role in r["cpu"]})
    cores = os.cpu_count() or 1
    cpu_rows = [[name, *(_share(runs[name], role, cores) for role in roles),
                 _share(runs[name], None, cores)] for name in CONFIGS]
    affinity_rows = [[routing, f"{a['hit_rate']:.0%}", f"{a['hits']:,} / {a['queries']:,}", f"{a['turn_p50']:.2f}",
                      f"{a['answered']}/{a['turns']}"] for routing, a in affinity.items()]
    text = "\n\n".join([
        f"`draftwise serve --model {settings.model} --replicas N --threads-per-replica T` (a local Ray cluster per "
        f"server), driven by the official `openai` client: {len(prompts)} streaming completions, greedy, up to "
        f"{max_tokens} tokens, {clients} clients in a closed loop; each config's server alone, {ROUNDS} rounds, "
        "the first rotating; speedups pool the rounds.",
        control_line(pooled["1x1 (control)"]["speedup"], baseline=BASELINE, control="1x1 (control)"),
        table(["config", "replicas x threads", "tokens/s", f"vs {BASELINE}", "tokens/s per round", "TTFT p50 s",
               "latency p50 s", "finished", "errors"], rows),
        f"Where the machine's CPU time went while the clients ran (share of {cores} cores x the run's wall time, "
        "both rounds; from /proc, each process by its command line):",
        table(["config", *roles, "idle"], cpu_rows),
        f"Affinity: two replicas, {CONVERSATIONS} conversations of {TURNS} turns in parallel (each its own system "
        f"prompt of ~{len(SYSTEM) // 4} tokens, its history growing; up to {TURN_TOKENS} tokens a turn). Prefix-cache "
        "hit rate over both replicas: prompt tokens found in the cache / looked up.",
        table(["routing", "prefix-cache hit rate", "hits / queries (tokens)", "turn latency p50 s", "answered"],
              affinity_rows)])
    return SuiteReport("replicas", text, {"runs": runs, "pooled": pooled, "affinity": affinity,
                                          "clients": clients, "rounds": ROUNDS})


class _server:
    """A replicated `draftwise serve`, ready, stopped (drained) on leaving."""

    def __init__(self, arguments: list[str], settings: BenchSettings, label: str) -> None:
        self.arguments, self.log = arguments, settings.output / f"replicas-{label}.log"

    def __enter__(self) -> Server:
        self.server = Server(self.arguments, self.log)
        try:
            self.server.wait_ready()
        except BaseException:
            self.server.stop()
            raise
        return self.server

    def __exit__(self, *exc) -> None:
        self.server.stop()


def _warm_up(server: Server, prompt: str) -> None:
    async def once() -> None:
        client = client_for(server.base, 300)
        for _ in range(2):  # (both replicas, most likely)
            await client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0)
        await client.close()

    asyncio.run(once())


def _share(results: list[dict], role: str | None, cores: int) -> str:
    """A role's CPU seconds over the runs as a share of the cores' time (None: what nobody used)."""
    capacity = cores * sum(r["wall"] for r in results)
    used = sum(sum(r["cpu"].values()) if role is None else r["cpu"].get(role, 0.0) for r in results)
    return f"{(capacity - used if role is None else used) / capacity:.0%}"


def _pool(results: list[dict]) -> dict:
    def median(key: str) -> float:
        values = sorted(r[key] for r in results if r[key] is not None)
        return values[len(values) // 2] if values else float("nan")

    tokens, seconds = sum(r["tokens"] for r in results), sum(r["seconds"] for r in results)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "ttft_p50": median("ttft_p50"), "latency_p50": median("latency_p50"),
            "finished": sum(r["finished"] for r in results), "requests": sum(r["requests"] for r in results),
            "errors": sum(len(r["errors"]) for r in results)}


def _conversations(common: list[str], settings: BenchSettings, routing: str) -> dict:
    with _server(common + ["--replicas", "2", "--threads-per-replica", "1", "--routing", routing], settings,
                 f"affinity-{routing}") as server:
        before = _prefix_counts(server.base)
        latencies = asyncio.run(_chat_turns(server))
        after = _prefix_counts(server.base)
    hits, queries = after[0] - before[0], after[1] - before[1]
    answered = sorted(t for t in latencies if t is not None)
    return {"hits": int(hits), "queries": int(queries), "hit_rate": hits / queries if queries else 0.0,
            "turn_p50": answered[len(answered) // 2] if answered else float("nan"), "answered": len(answered),
            "turns": len(latencies)}


async def _chat_turns(server: Server) -> list[float | None]:
    client = client_for(server.base, 300)
    latencies: list[float | None] = []

    async def conversation(index: int) -> None:
        messages = [{"role": "system", "content": f"Team {index}. {SYSTEM}"},
                    {"role": "user", "content": f"Write a function that parses log line number {index}."}]
        for turn in range(TURNS):
            started = time.perf_counter()
            try:
                answer = await client.chat.completions.create(model=server.model, messages=messages,
                                                              max_tokens=TURN_TOKENS, temperature=0)
                latencies.append(time.perf_counter() - started)
            except Exception:  # (counted as unanswered)
                latencies.append(None)
                return
            messages += [{"role": "assistant", "content": answer.choices[0].message.content or ""},
                         {"role": "user", "content": f"Now handle case {turn + 2} as well."}]

    await asyncio.gather(*(conversation(i) for i in range(CONVERSATIONS)))
    await client.close()
    return latencies


def _prefix_counts(base: str) -> tuple[float, float]:
    """(hits, queries) of the prefix cache summed over the replicas, from the merged /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        text = response.read().decode()
    totals = {"draftwise:prefix_cache_hits_total": 0.0, "draftwise:prefix_cache_queries_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals["draftwise:prefix_cache_hits_total"], totals["draftwise:prefix_cache_queries_total"]
