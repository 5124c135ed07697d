"""How many replicas, and which speculation policy in each (`draftwise plan --replicas 1,2`).

A replica (`draftwise serve --replicas`) is one engine of `threads_per_replica` threads; the plan's
own runs are made at that thread count, so its costs are one replica's. With R replicas and C
clients in a closed loop, routing by least outstanding requests keeps C/R of them on each replica
(as evenly as integers allow: 8 clients on 3 replicas are 3, 3 and 2), and the replicas share
nothing but the machine. So R replicas at C clients serve what one replica serves at each share,
summed:

    tokens/s (R, C, config) = sum over replicas i of tokens/s (one replica, share_i, config)
    p95 latency (R, C, config) = the largest p95 among the shares

with the same configuration in every replica, as long as the machine has the cores: the replicas'
threads and the serving stack beside them (Ray Serve's proxy, the ingress, Ray's daemons: SERVING_CORES,
measured). Where they do not fit, the replicas share what is left, each getting

    core share (R) = min(1, (cores - SERVING_CORES) / (R threads_per_replica))

of its threads' time, and its throughput and latency are scaled by it (two replicas of one thread
on 2 cores: 0.85; measured there, the replicas got 1.56 of the 2 cores and the proxy, ingress and
daemons 0.30, the load generator 0.04). Memory bandwidth is shared too: replicas of one machine each
read their own copy of the weights, so where one replica already saturates it the sum is still
optimistic; `draftwise bench --suite replicas` measures it (BENCHMARKS.md, "replicas").

A target (`target_qps` requests per second, within `slo_p95` seconds at the 95th percentile) picks
the smallest replica count, and at it the client count and configuration, that meets it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# Cores the serving stack beside the replicas takes: Ray Serve's proxy (3%), the ingress (7%) and
# Ray's daemons (5%) of a 2-core AMD EPYC while two replicas served 8 streaming clients
# (BENCHMARKS.md, "Replicas with the CPU time accounted, role by role").
SERVING_CORES = 0.3


@dataclass(frozen=True, slots=True)
class FleetOptions:
    replicas: tuple[int, ...]  # replica counts weighed
    threads_per_replica: int = 1
    target_qps: float | None = None  # requests per second wanted
    slo_p95: float | None = None  # seconds, end to end, at the 95th percentile
    cores: int | None = None  # the machine's cores (None: this machine's)


def core_share(replicas: int, options: FleetOptions) -> float:
    """The share of its threads' time each of `replicas` replicas gets beside the serving stack."""
    cores = machine_cores(options)
    wanted = replicas * options.threads_per_replica
    return min(1.0, max(cores - SERVING_CORES, 0.0) / wanted) if wanted + SERVING_CORES > cores else 1.0


def machine_cores(options: FleetOptions) -> int:
    return options.cores or os.cpu_count() or 1


def shares(clients: int, replicas: int) -> list[int]:
    """Clients per replica under least-outstanding routing (replicas beyond the clients idle)."""
    return [clients // replicas + (1 if i < clients % replicas else 0) for i in range(replicas)
            if clients // replicas + (1 if i < clients % replicas else 0) > 0]


def share_levels(levels: tuple[int, ...], replicas: tuple[int, ...]) -> tuple[int, ...]:
    """Every per-replica client count the fleet's predictions need (one replica simulated at each)."""
    return tuple(sorted({share for c in levels for r in replicas for share in shares(c, r)} | set(levels)))


def predict_fleet(one_replica: dict[str, dict[int, dict]], levels: tuple[int, ...], options: FleetOptions,
                  mean_output_tokens: float) -> dict:
    """one_replica: config -> per-replica client count -> a simulated Prediction (as a dict).

    Returns {"rows": [...], "best": {replicas: {clients: row}}, "target": row or None}: a row per
    (replicas, clients, config) with tokens/s, requests/s and p95 latency."""
    rows = []
    for replicas in options.replicas:
        for clients in levels:
            split = shares(clients, replicas)
            share = core_share(len(split), options)
            for config, by_share in one_replica.items():
                points = [by_share[clients_here] for clients_here in split]
                tokens_per_second = share * sum(p["tokens_per_second"] for p in points)
                rows.append({"replicas": replicas, "clients": clients, "config": config,
                             "tokens_per_second": tokens_per_second,
                             "requests_per_second": tokens_per_second / mean_output_tokens if mean_output_tokens else 0.0,
                             "latency_p95": max(p["latency_p95"] for p in points) / share, "shares": split,
                             "core_share": share})
    best: dict[int, dict[int, dict]] = {}
    for row in rows:
        current = best.setdefault(row["replicas"], {}).get(row["clients"])
        if current is None or row["tokens_per_second"] > current["tokens_per_second"]:
            best[row["replicas"]][row["clients"]] = row
    return {"rows": rows, "best": best, "target": meeting_target(rows, options)}


def meeting_target(rows: list[dict], options: FleetOptions) -> dict | None:
    """The fewest replicas that serve `target_qps` within `slo_p95` (and at them the configuration
    with the most headroom); None without a target or where no row meets it."""
    if options.target_qps is None:
        return None
    fits = [row for row in rows if row["requests_per_second"] >= options.target_qps
            and (options.slo_p95 is None or row["latency_p95"] <= options.slo_p95)]
    if not fits:
        return None
    fewest = min(row["replicas"] for row in fits)
    return max((row for row in fits if row["replicas"] == fewest), key=lambda row: row["requests_per_second"])


def render_fleet(fleet: dict, options: FleetOptions) -> list[str]:
    cores = machine_cores(options)
    lines = ["", f"Replicas of {options.threads_per_replica} thread(s) each (the plan's costs are one such "
             "replica's; clients split evenly across replicas; the same configuration in each; core share: what "
             f"each replica gets of its threads' time on {cores} cores beside the serving stack's ~{SERVING_CORES:g}):",
             "", "| replicas | clients | best configuration | tok/s | requests/s | p95 s | core share | vs 1 replica |",
             "|---|---|---|---|---|---|---|---|"]
    for replicas, by_clients in sorted(fleet["best"].items()):
        for clients, row in sorted(by_clients.items()):
            single = fleet["best"].get(1, {}).get(clients)
            versus = f"{row['tokens_per_second'] / single['tokens_per_second']:.2f}x" if single else "-"
            share = row.get("core_share", 1.0)  # (plans saved before the core share have none)
            lines.append(f"| {replicas} | {clients} | {row['config']} | {row['tokens_per_second']:.1f} | "
                         f"{row['requests_per_second']:.2f} | {row['latency_p95']:.1f} | {share:.2f} | {versus} |")
    if options.target_qps is not None:
        target = fleet["target"]
        slo = f" within a p95 of {options.slo_p95:g} s" if options.slo_p95 is not None else ""
        if target is None:
            lines += ["", f"No replica count weighed serves {options.target_qps:g} requests/s{slo}: weigh more "
                      "replicas (--replicas) or machines."]
        else:
            lines += ["", f"For {options.target_qps:g} requests/s{slo}: {target['replicas']} replica(s) of "
                      f"{options.threads_per_replica} thread(s), {target['config']} in each, at {target['clients']} "
                      f"clients ({target['requests_per_second']:.2f} requests/s, p95 {target['latency_p95']:.1f} s)."]
    return lines
