"""Which replica serves a request: least outstanding requests, with affinity.

A request with an affinity key (a conversation, a shared prompt: `affinity.py`) goes to the replica its
key ranks first (rendezvous hashing: every key ranks all replicas, so a key keeps its replica as long as
that replica is up, and only its own keys move when one goes down), unless that replica has more than
`load_slack` requests outstanding beyond the least loaded one: then to the next in the key's ranking
within that bound (bounded-load hashing), so affinity never piles work on one replica. Without a key,
or with routing "least_loaded", the least loaded replica; "random" picks uniformly (the baseline
affinity is measured against). Replicas marked down are skipped until marked up again.
"""

from __future__ import annotations

import hashlib
import random
import threading
from dataclasses import dataclass

from draftwise.errors import InvalidParameterError

POLICIES = ("affinity", "least_loaded", "random")


class NoReplicaError(RuntimeError):
    """Every replica is down."""


@dataclass(frozen=True, slots=True)
class Choice:
    replica: int
    outcome: str  # "affinity" (the key's first choice), "spilled" (a later one: load), "least_loaded", "random"


class Router:
    def __init__(self, replicas: int, policy: str = "affinity", load_slack: int = 2, seed: int | None = None) -> None:
        if policy not in POLICIES:
            raise InvalidParameterError(f"routing must be one of {', '.join(POLICIES)}, got {policy!r}")
        if replicas < 1:
            raise InvalidParameterError("at least one replica")
        self.policy, self.load_slack = policy, load_slack
        self.outstanding = [0] * replicas
        self.up = [True] * replicas
        self._random = random.Random(seed)
        self._lock = threading.Lock()

    def choose(self, key: str | None, exclude: frozenset[int] = frozenset()) -> Choice:
        """A replica for a request (not one in `exclude`: tried already), counted as outstanding."""
        with self._lock:
            live = [i for i, up in enumerate(self.up) if up and i not in exclude]
            if not live:
                raise NoReplicaError("no replica is up")
            if self.policy == "random":
                choice = Choice(self._random.choice(live), "random")
            elif self.policy == "least_loaded" or key is None:
                choice = Choice(min(live, key=lambda i: (self.outstanding[i], i)), "least_loaded")
            else:
                least = min(self.outstanding[i] for i in live)
                ranked = sorted(live, key=lambda i: _rank(key, i), reverse=True)
                first_fit = next(i for i in ranked if self.outstanding[i] <= least + self.load_slack)
                choice = Choice(first_fit, "affinity" if first_fit == ranked[0] else "spilled")
            self.outstanding[choice.replica] += 1
            return choice

    def finished(self, replica: int) -> None:
        with self._lock:
            self.outstanding[replica] = max(0, self.outstanding[replica] - 1)

    def mark(self, replica: int, up: bool) -> None:
        with self._lock:
            self.up[replica] = up


def _rank(key: str, replica: int) -> int:
    """The key's rendezvous score for a replica (stable across processes: not Python's hash)."""
    return int.from_bytes(hashlib.blake2b(f"{replica}\0{key}".encode(), digest_size=8).digest(), "big")
