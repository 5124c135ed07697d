"""The replicas suite's CPU accounting: processes put in roles by their command lines, CPU time
summed per role between two snapshots of /proc."""

import os
import time

import pytest

from draftwise.benchmark import cpu_shares

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")


def test_processes_are_put_in_roles_by_their_command_lines():
    assert cpu_shares._role(1, "ray::ServeReplica:draftwise:draftwise-ingress") == "ingress"
    assert cpu_shares._role(1, "ray::ServeReplica:draftwise:draftwise-replica-0") == "engine replicas"
    assert cpu_shares._role(1, "ray::ProxyActor") == "Ray Serve proxy"
    assert cpu_shares._role(1, "/usr/bin/raylet --node_id x") == "Ray's daemons"
    assert cpu_shares._role(1, "python -m http.server") == cpu_shares.OTHER
    assert cpu_shares._role(os.getpid(), "ray::ProxyActor") == cpu_shares.LOAD_GENERATOR


def test_cpu_time_between_snapshots_is_summed_per_role():
    before = {1: ("ingress", 2.0), 2: ("engine replicas", 5.0), 3: ("engine replicas", 1.0), 4: ("gone", 9.0)}
    after = {1: ("ingress", 2.5), 2: ("engine replicas", 7.0), 3: ("engine replicas", 1.5), 5: ("Ray's daemons", 0.25)}
    assert cpu_shares.cpu_seconds(before, after) == {"ingress": 0.5, "engine replicas": 2.5, "Ray's daemons": 0.25}


def test_this_process_working_shows_as_the_load_generator():
    before = cpu_shares.snapshot()
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    spent = cpu_shares.cpu_seconds(before, cpu_shares.snapshot())
    assert spent[cpu_shares.LOAD_GENERATOR] >= 0.2
