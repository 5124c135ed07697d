"""Where a machine's CPU time went during a run, by role: read from /proc (Linux) before and after,
every process's user + system time, each process put in a role by its command line.

The replicas suite needs it: on a 2-core machine the replicas, the load generator, Ray Serve's
proxy, the ingress and Ray's own daemons all share the cores, and a throughput ratio alone cannot
say which of them kept the replicas from scaling.
"""

from __future__ import annotations

import os
from pathlib import Path

# (substring of the command line, role), first match wins; Ray titles its workers "ray::Class..."
ROLES = (
    ("draftwise-ingress", "ingress"),
    ("ServeReplica", "engine replicas"),
    ("ProxyActor", "Ray Serve proxy"),
    ("ServeController", "Ray's daemons"),
    ("raylet", "Ray's daemons"), ("gcs_server", "Ray's daemons"), ("dashboard", "Ray's daemons"),
    ("log_monitor", "Ray's daemons"), ("monitor.py", "Ray's daemons"), ("runtime_env", "Ray's daemons"),
    ("ray::", "Ray's daemons"),
)
LOAD_GENERATOR = "load generator (this process)"
OTHER = "everything else"


def snapshot() -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) for every process readable now."""
    ticks = os.sysconf("SC_CLK_TCK")
    processes = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # (gone meanwhile, or not ours to read)
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm)": state is field 3, utime 14, stime 15
        processes[int(entry.name)] = (_role(int(entry.name), command), (int(fields[11]) + int(fields[12])) / ticks)
    return processes


def cpu_seconds(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds spent per role between two snapshots (a process started meanwhile counts whole)."""
    spent: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        earlier = before.get(pid)
        used = seconds - earlier[1] if earlier is not None and earlier[0] == role else seconds
        spent[role] = spent.get(role, 0.0) + max(0.0, used)
    return spent


def _role(pid: int, command: str) -> str:
    if pid == os.getpid():
        return LOAD_GENERATOR
    for needle, role in ROLES:
        if needle in command:
            return role
    return OTHER
