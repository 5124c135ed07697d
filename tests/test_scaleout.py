"""Scale-out on Ray Serve: routing and affinity keys (unit), the merged metrics view, and a real local
Ray cluster running `draftwise serve --replicas 2 --threads-per-replica 1` on the tiny model, driven
with the official `openai` client: answers and streams pass through, a conversation keeps its
replica, /metrics labels every replica, a replica killed mid-stream ends that stream with an error
event while the other serves and Ray restarts it, and SIGTERM drains."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import httpx
import pytest

from draftwise.errors import InvalidParameterError
from draftwise.scaleout.affinity import affinity_key
from draftwise.scaleout.launch import READY_LINE, replica_argv
from draftwise.scaleout.metrics import merge_replica_metrics
from draftwise.scaleout.routing import NoReplicaError, Router

ray = pytest.importorskip("ray")

CHAT = "/v1/chat/completions"
REQUEST_LIMIT = 65536


# --- routing ----------------------------------------------------------------------------------
def test_a_key_keeps_its_replica_and_keys_spread():
    router = Router(4, "affinity")
    first = {f"conversation {i}": router.choose(f"conversation {i}").replica for i in range(64)}
    for key, replica in first.items():
        router.finished(replica)
    assert all(router.choose(key).replica == replica for key, replica in first.items())  # (load stays within slack)
    assert len(set(first.values())) == 4


def test_affinity_spills_to_the_next_replica_when_its_own_is_overloaded():
    router = Router(2, "affinity", load_slack=2)
    home = router.choose("key").replica
    choices = [router.choose("key") for _ in range(6)]  # nothing finishes: the home replica fills up
    assert Counter(c.replica for c in choices)[1 - home] >= 2
    assert {c.outcome for c in choices} == {"affinity", "spilled"}
    assert max(router.outstanding) - min(router.outstanding) <= 3


def test_down_replicas_are_skipped_and_keys_move_only_off_them():
    router = Router(3, "affinity")
    homes = {f"k{i}": router.choose(f"k{i}").replica for i in range(30)}
    router.outstanding = [0, 0, 0]
    router.mark(0, False)
    for key, home in homes.items():
        replica = router.choose(key).replica
        router.finished(replica)
        assert replica != 0 and (home == 0 or replica == home)
    for replica in (1, 2):
        router.mark(replica, False)
    with pytest.raises(NoReplicaError):
        router.choose("k1")


def test_least_loaded_random_and_keyless_requests():
    router = Router(3, "least_loaded")
    assert [router.choose("same key").replica for _ in range(3)] == [0, 1, 2]
    router = Router(3, "affinity")
    assert [router.choose(None).replica for _ in range(3)] == [0, 1, 2]
    router = Router(2, "random", seed=0)
    assert {router.choose("k").replica for _ in range(40)} == {0, 1}
    assert router.choose("k", exclude=frozenset({0})).replica == 1
    with pytest.raises(InvalidParameterError, match="routing"):
        Router(2, "round_robin")


# --- affinity keys ------------------------------------------------------------------------------
def chat(messages: list[dict], **fields) -> bytes:
    return json.dumps({"model": "m", "messages": messages, **fields}).encode()


def test_the_turns_of_a_conversation_share_a_key_and_other_conversations_do_not():
    system = {"role": "system", "content": "You are terse."}
    turn1 = [system, {"role": "user", "content": "Name a prime."}]
    turn2 = turn1 + [{"role": "assistant", "content": "7"}, {"role": "user", "content": "Another."}]
    other = [system, {"role": "user", "content": "Name a colour."}]
    key = affinity_key(CHAT, {}, chat(turn1))
    assert key == affinity_key(CHAT, {}, chat(turn2)) != affinity_key(CHAT, {}, chat(other))
    assert affinity_key(CHAT, {"x-session-id": "s1"}, chat(other)) == "session:s1"
    assert affinity_key(CHAT, {}, chat(other, user="alice")) == "user:alice"


def test_completion_keys_follow_the_prompts_head_and_junk_has_none():
    shared = "x" * 2000
    one = json.dumps({"model": "m", "prompt": shared + " first"}).encode()
    two = json.dumps({"model": "m", "prompt": shared + " second"}).encode()
    assert affinity_key("/v1/completions", {}, one) == affinity_key("/v1/completions", {}, two) is not None
    assert affinity_key("/v1/completions", {}, b"{not json") is None
    assert affinity_key("/v1/models", {}, b"") is None


def test_replica_arguments_leave_the_ingress_flags_out():
    argv = ["--model", "m", "--replicas", "2", "--host=0.0.0.0", "--port", "9000", "--routing", "random",
            "--threads-per-replica", "1", "--max-num-seqs", "4", "--api-key", "k"]
    assert replica_argv(argv) == ["--model", "m", "--max-num-seqs", "4"]


def test_metrics_of_replicas_merge_with_a_replica_label():
    from prometheus_client import CollectorRegistry, Counter as PromCounter, generate_latest

    def replica_text(count: int) -> str:  # (as each replica's /metrics renders it)
        registry = CollectorRegistry()
        PromCounter("draftwise:request_success", "Finished requests.", ["model_name"], registry=registry).labels(
            "m").inc(count)
        return generate_latest(registry).decode()

    families = {f.name: f for f in merge_replica_metrics({0: replica_text(3), 1: replica_text(5)})}
    family = families["draftwise:request_success"]
    totals = {s.labels["replica"]: s.value for s in family.samples if s.name.endswith("_total")}
    assert totals == {"0": 3.0, "1": 5.0}


def test_unknown_application_arguments_are_refused_by_name():
    from draftwise.scaleout.application import build

    with pytest.raises(InvalidParameterError, match="replica_count"):
        build({"serve_args": ["--model", "m"], "replica_count": 2}, make_server=None)


def test_the_ingress_reads_no_body_past_its_limit():
    import asyncio

    from starlette.requests import Request

    from draftwise.scaleout.ingress import limited_body

    def request(chunks: list[bytes], length: int | None):
        messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
        read = []

        async def receive():
            read.append(1)
            return messages[len(read) - 1]

        headers = [] if length is None else [(b"content-length", str(length).encode())]
        return Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive), read

    whole, read = request([b"a" * 600, b"b" * 600], None)
    assert asyncio.run(limited_body(whole, 2048)) == b"a" * 600 + b"b" * 600
    over, read = request([b"a" * 600, b"b" * 600, b"c" * 600, b"d" * 600], None)  # no length said: read until over
    assert asyncio.run(limited_body(over, 1024)) is None and len(read) == 2
    declared, read = request([b"a" * 10], 5000)  # its Content-Length says it is too large: nothing read
    assert asyncio.run(limited_body(declared, 1024)) is None and read == []


def test_each_api_key_is_a_tenant_across_the_ingress_and_its_replicas(tiny_qwen):
    """The ingress finds the key's tenant and the replica's server drafts from that tenant's text only
    (its own server checks no key): the two halves of the path, without a cluster."""
    import asyncio

    from starlette.requests import Request

    from draftwise import LLM
    from draftwise.scaleout.asgi_call import call_asgi
    from draftwise.server.app import build_app
    from draftwise.server.async_engine import AsyncEngine
    from draftwise.server.security import tenant_of

    ingress_class, ingress = stand_in_ingress([StandInReplica(None)], api_key=("alpha", "beta"))
    check_key = ingress_class._check_key

    def request_with(key: str, scheme: str = "Bearer") -> Request:
        return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                        "headers": [(b"host", b"localhost"), (b"authorization", f"{scheme} {key}".encode())]})

    beta = request_with("beta")
    assert check_key(ingress, beta) is None and beta.state.tenant == tenant_of(b"beta")
    assert check_key(ingress, request_with("gamma")).status_code == 401
    # (the scheme in any case, as one server takes it; a key under another scheme is no key)
    assert check_key(ingress, lowercase := request_with("alpha", "bearer")) is None
    assert lowercase.state.tenant == tenant_of(b"alpha")
    assert check_key(ingress, request_with("alpha", "Basic")).status_code == 401

    llm = LLM(str(tiny_qwen), max_model_len=128, progress=False)
    llm.prepare_drafter("suffix")
    engine = AsyncEngine(llm)
    app = build_app(engine, "tiny")
    body = json.dumps({"model": "tiny", "prompt": "one two", "max_tokens": 4, "temperature": 0,
                       "speculative": {"method": "suffix"}}).encode()

    async def answer() -> list:
        return [item async for item in call_asgi(app, "POST", "/v1/completions", "", [("content-type", "application/json")],
                                                 body, {"tenant": beta.state.tenant})]

    try:
        assert asyncio.run(answer())[0]["status"] == 200
    finally:
        engine.drain(0.0)
    assert set(llm.engine.drafters["suffix"].proposer.cache.partitions) == {tenant_of(b"beta")}


def test_scale_out_flags_are_checked_before_anything_starts(tiny_qwen):
    from draftwise.scaleout.application import build

    cases = [(("--routing", "random"), "need --replicas"), (("--replicas", "0"), "at least 1"),
             (("--replicas", "2", "--threads-per-replica", "0"), "at least 1"),
             (("--replicas", "2", "--allowed-origins", "https://app.example"), "--allowed-origins (CORS) is not")]
    for extra, message in cases:
        result = subprocess.run([sys.executable, "-m", "draftwise", "serve", "--model", str(tiny_qwen), *extra],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
    with pytest.raises(InvalidParameterError, match="routing must be one of"):
        build({"serve_args": [], "routing": "round_robin"}, make_server=None)
    with pytest.raises(InvalidParameterError, match="max_request_bytes must be"):
        build({"serve_args": [], "max_request_bytes": 10}, make_server=None)


# --- the ingress in-process, in front of stand-in replicas --------------------------------------
class StandInStream:
    """What a Ray Serve streaming handle call gives the ingress: items, then the end; `cancel()`."""

    def __init__(self, items: list, hang: bool = False) -> None:
        self.items, self.hang, self.cancelled = list(items), hang, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        import asyncio

        if self.hang:
            await asyncio.sleep(3600)
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class StandInReplica:
    """A replica deployment's handle: `forward` calls answered by `answer(*args)` (a StandInStream)."""

    def __init__(self, answer) -> None:
        self.answer, self.calls, self.streams = answer, [], []

    def options(self, **_):
        return self

    @property
    def forward(self):
        return self

    def remote(self, *args):
        self.calls.append(args)
        self.streams.append(stream := self.answer(*args))
        return stream


def stand_in_ingress(replicas: list, **options):
    from draftwise.scaleout.ingress import Ingress

    ingress_class = Ingress.func_or_class.__mro__[1]  # (the class Ray Serve wraps)
    ingress = ingress_class(*replicas, replica_names=tuple(f"r{i}" for i in range(len(replicas))), **options)
    for index in range(len(replicas)):
        ingress._mark(index, True)
    ingress._prober = SimpleNamespaceTask()  # (no probe rounds: the replicas are up)
    return ingress_class, ingress


class SimpleNamespaceTask:
    def done(self) -> bool:
        return False


def http_request(method: str, path: str, body: bytes = b"", headers: tuple = (("host", "localhost"),)):
    import asyncio

    from starlette.requests import Request

    sent = []

    async def receive():
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)

    return Request({"type": "http", "method": method, "path": path, "query_string": b"",
                    "headers": [(k.encode(), v.encode()) for k, v in headers]}, receive)


def test_a_client_gone_before_or_at_the_answer_frees_its_replica_and_aborts_its_request():
    """Cancelled while the replica works (a non-streaming answer's first byte is its last), or gone
    when the response starts: either way the router's count returns to 0 and the replica's request
    is cancelled (the count leaked before, and with it every drain waited its whole timeout)."""
    import asyncio

    ok = [{"status": 200, "headers": [("content-type", "text/event-stream")]}, b"data: 1\n\n"]
    waiting = StandInReplica(lambda *args: StandInStream([], hang=True))
    answering = StandInReplica(lambda *args: StandInStream(ok))
    body = b'{"model": "m", "prompt": "hi"}'

    async def cancelled_while_waiting():
        cls, ingress = stand_in_ingress([waiting])
        task = asyncio.create_task(cls.forward(ingress, http_request("POST", "/v1/completions", body), ""))
        await asyncio.sleep(0.1)
        assert ingress.router.outstanding == [1]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return ingress.router.outstanding, await ingress.drain(0.1)

    assert asyncio.run(cancelled_while_waiting()) == ([0], 0) and waiting.streams[0].cancelled

    from starlette.requests import ClientDisconnect

    async def gone_at_the_start():
        cls, ingress = stand_in_ingress([answering])
        response = await cls.forward(ingress, http_request("POST", "/v1/completions", body), "")

        async def send(message):
            raise OSError("the client went away")

        with pytest.raises(ClientDisconnect):  # (starlette's name for a send that failed)
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, lambda: asyncio.sleep(3600), send)
        return ingress.router.outstanding

    assert asyncio.run(gone_at_the_start()) == [0] and answering.streams[0].cancelled


def test_ingress_metrics_skip_replicas_that_are_down_slow_or_answer_otherwise():
    """/metrics answers with the replicas that answered with metrics: a replica marked down is not
    asked (a call there waits for minutes), a slow one is given up on, a 401 (a replica with a key
    of its own) is left out, not parsed into a 500."""
    import asyncio

    metrics = b"# HELP draftwise:up_total x\n# TYPE draftwise:up_total counter\ndraftwise:up_total 1.0\n"
    good = StandInReplica(lambda *args: StandInStream([{"status": 200, "headers": []}, metrics]))
    refusing = StandInReplica(lambda *args: StandInStream([{"status": 401, "headers": []}, b'{"error": {}}']))
    slow = StandInReplica(lambda *args: StandInStream([], hang=True))
    down = StandInReplica(lambda *args: pytest.fail("a replica marked down was asked"))

    async def scrape():
        cls, ingress = stand_in_ingress([good, refusing, slow, down])
        ingress._mark(3, False)
        ingress.probe_timeout = 0.2
        return await asyncio.wait_for(cls.prometheus(ingress, http_request("GET", "/metrics")), 5)

    response = asyncio.run(scrape())
    text = response.body.decode()
    assert response.status_code == 200 and 'draftwise:up_total{replica="0"} 1.0' in text
    assert 'replica="1"' not in text.split("draftwise:router")[0] and slow.streams[0].cancelled


def test_the_ingress_answers_as_one_server_does():
    """401 with WWW-Authenticate; /health checks Host names; every method reaches a replica (which
    answers 405 where one server does); a body nested past Python's limit has no affinity key."""
    import asyncio

    replica = StandInReplica(lambda *args: StandInStream([{"status": 405, "headers": []}, b"{}"]))

    async def answers():
        cls, ingress = stand_in_ingress([replica], api_key=("alpha",), allowed_hosts=("localhost",))
        refused = await cls.forward(ingress, http_request("POST", "/v1/completions"), "")
        foreign = await cls.health(ingress, http_request("GET", "/health", headers=(("host", "evil.example"),)))
        put = await cls.forward(ingress, http_request("PUT", "/v1/completions", headers=(
            ("host", "localhost"), ("authorization", "Bearer alpha"))), "")
        return refused, foreign, put

    refused, foreign, put = asyncio.run(answers())
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert foreign.status_code == 400 and b"invalid_host" in foreign.body
    assert put.status_code == 405 and replica.calls[0][0] == "PUT"
    deep = b'{"messages": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    assert affinity_key(CHAT, {}, deep) is None


@pytest.mark.parametrize("args, message", [
    ({"serve_args": "--model m"}, "serve_args must be a list of strings"),
    ({"serve_args": [], "allowed_hosts": "api.example"}, "allowed_hosts must be a list of strings"),
    ({"serve_args": [], "api_key": ""}, "api_key"),
    ({"serve_args": [], "api_key": 123}, "api_key"),
    ({"serve_args": [], "threads_per_replica": 1.5}, "threads_per_replica must be an integer"),
    ({"serve_args": [], "max_ongoing_requests": 0}, "max_ongoing_requests must be an integer"),
    ({"serve_args": [], "drain_timeout": -5}, "drain_timeout must be"),
])
def test_serve_config_arguments_are_checked_by_name(args, message):
    from draftwise.scaleout.application import build

    with pytest.raises(InvalidParameterError, match=message):
        build(args, make_server=None)


def test_replicas_take_no_abbreviated_flag_no_key_of_their_own_and_no_unknown_model(tiny_qwen, monkeypatch, capsys):
    """An abbreviated ingress flag would reach the replicas (the ingress's flags are left out by exact
    name): refused. A replica checks no key, even with DRAFTWISE_API_KEY in its environment (the
    ingress asks its /metrics without one). A bad --model is said before Ray starts."""
    import asyncio

    from draftwise.cli import main
    from draftwise.cli.serve import parse_serve_argv, server_from_argv
    from draftwise.scaleout.asgi_call import call_asgi

    with pytest.raises(SystemExit):
        parse_serve_argv(["--model", "m", "--api-k", "secret"])
    monkeypatch.setenv("DRAFTWISE_API_KEY", "secret")
    app, engine = server_from_argv(["--model", str(tiny_qwen), "--max-model-len", "128", "--allowed-hosts", "*"])

    async def metrics() -> dict:
        return [item async for item in call_asgi(app, "GET", "/metrics", "", [], b"")][0]

    try:
        assert asyncio.run(metrics())["status"] == 200
    finally:
        engine.drain(0.0)
    assert main(["serve", "--model", "/nonexistent/model", "--replicas", "1"]) == 2
    assert "/nonexistent/model" in capsys.readouterr().err


# --- a real local Ray cluster --------------------------------------------------------------------
class ReplicatedServer:
    def __init__(self, model, *extra: str) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "draftwise", "serve", "--model", str(model), "--port", str(self.port),
                   "--replicas", "2", "--threads-per-replica", "1", "--max-model-len", "512", "--max-num-seqs", "4",
                   *extra]
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                        env={**os.environ, "RAY_DEDUP_LOGS": "0"})
        deadline = time.time() + 240
        for line in self.process.stderr:
            if READY_LINE in line:
                break
            assert time.time() < deadline and self.process.poll() is None, "the replicated server did not start"
        self.health()  # (its first call waits for one round of probes)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=30).json()

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True)


@pytest.fixture(scope="module")
def replicated(tiny_qwen):
    server = ReplicatedServer(tiny_qwen, "--max-request-bytes", str(REQUEST_LIMIT))
    yield server
    server.stop()


def test_answers_and_streams_pass_through_equal_to_one_engine(replicated, tiny_qwen):
    # One engine at the replicas' thread count: each count has its own measured kernel choices
    # (`quant/activation_choice.py`), so an engine on two threads may round otherwise.
    one_engine = ("import json, torch; torch.set_num_threads(1); from draftwise import LLM, SamplingParams; "
                  f"llm = LLM({str(tiny_qwen)!r}, max_model_len=512, progress=False); print(json.dumps(llm.generate("
                  "['def add(a, b):'], SamplingParams(temperature=0, max_tokens=12))[0].text))")
    result = subprocess.run([sys.executable, "-c", one_engine], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    expected = json.loads(result.stdout.strip().splitlines()[-1])
    client = replicated.client()
    answer = client.completions.create(model=str(tiny_qwen), prompt="def add(a, b):", max_tokens=12, temperature=0,
                                       logprobs=0)
    streamed = [token for chunk in client.completions.create(model=str(tiny_qwen), prompt="def add(a, b):",
                                                             max_tokens=12, temperature=0, stream=True, logprobs=0)
                for token in (chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else [])]
    assert answer.choices[0].text == expected
    assert streamed == answer.choices[0].logprobs.tokens and len(streamed) == 12  # (the tiny model's text is
    # often partial UTF-8, which a stream and a whole answer cut differently: tokens compared)
    with pytest.raises(Exception, match="max_tokens"):  # (the replica's validation, passed through)
        client.completions.create(model=str(tiny_qwen), prompt="x", max_tokens=-1)
    too_large = httpx.post(replicated.url + "/v1/completions", timeout=30,
                           json={"model": str(tiny_qwen), "prompt": "word " * REQUEST_LIMIT, "max_tokens": 2})
    assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "request_too_large"
    assert "x-draftwise-replica" not in too_large.headers  # refused by the ingress itself


def test_a_conversation_keeps_its_replica_and_conversations_use_both(replicated, tiny_qwen):
    client = replicated.client()
    served = {}
    for conversation in range(8):
        messages = [{"role": "user", "content": f"question {conversation}"}]
        replicas = set()
        for _ in range(3):
            raw = client.chat.completions.with_raw_response.create(model=str(tiny_qwen), messages=messages,
                                                                    max_tokens=4, temperature=0)
            replicas.add(raw.headers["x-draftwise-replica"])
            messages += [{"role": "assistant", "content": raw.parse().choices[0].message.content},
                         {"role": "user", "content": "and then?"}]
        assert len(replicas) == 1, replicas
        served[conversation] = replicas.pop()
    assert set(served.values()) == {"0", "1"}


def test_metrics_label_every_replica(replicated, tiny_qwen):
    client = replicated.client()
    for i in range(6):
        client.completions.create(model=str(tiny_qwen), prompt=f"metrics {i}", max_tokens=2)
    text = httpx.get(replicated.url + "/metrics", timeout=30).text
    replicas = {line.split('replica="')[1][0] for line in text.splitlines()
                if line.startswith("draftwise:request_success_total")}
    assert replicas == {"0", "1"}
    assert "draftwise:router_requests_total" in text and 'draftwise:replica_up{replica="1"} 1.0' in text
    assert replicated.health()["replicas"].keys() == {"0", "1"}


def test_a_replica_killed_mid_stream_ends_its_stream_with_an_error_and_comes_back(replicated, tiny_qwen):
    health = replicated.health()
    body = {"model": str(tiny_qwen), "prompt": "def add(a, b):", "max_tokens": 480, "stream": True,
            "ignore_eos": True}
    lines = []
    with httpx.stream("POST", replicated.url + "/v1/completions", json=body, timeout=120) as response:
        victim = response.headers["x-draftwise-replica"]
        for line in response.iter_lines():
            if line:
                lines.append(line)
                if len(lines) == 3:
                    os.kill(health["replicas"][victim]["pid"], signal.SIGKILL)
    assert "replica_failed" in lines[-1] and lines[-1].startswith("data: {\"error\"")
    assert all("[DONE]" not in line for line in lines)
    client = replicated.client()
    for i in range(4):  # the other replica answers meanwhile
        assert client.completions.create(model=str(tiny_qwen), prompt=f"after {i}", max_tokens=2).choices
    deadline = time.time() + 120
    while replicated.health()["replicas"][victim]["state"] != "up":
        assert time.time() < deadline, "Ray Serve did not restart the replica"
        time.sleep(1)
    assert replicated.health()["replicas"][victim]["pid"] != health["replicas"][victim]["pid"]


def test_sigterm_drains_running_streams_and_refuses_new_requests(tiny_qwen):
    server = ReplicatedServer(tiny_qwen, "--drain-timeout", "60")
    try:
        body = {"model": str(tiny_qwen), "prompt": "def add(a, b):", "max_tokens": 300, "stream": True,
                "ignore_eos": True}
        lines = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    if len(lines) == 3:
                        server.process.send_signal(signal.SIGTERM)
                        time.sleep(0.5)
                        refused = httpx.post(server.url + "/v1/completions", timeout=30,
                                             json={"model": str(tiny_qwen), "prompt": "x", "max_tokens": 2})
        assert lines[-1] == "data: [DONE]" and '"finish_reason": "length"' in lines[-2]
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        assert server.process.wait(timeout=60) == 0
    finally:
        server.stop()


def test_the_replicas_suite_measures_throughput_and_affinity(tiny_qwen, tmp_path, monkeypatch):
    """`draftwise bench --suite replicas`, shrunk (one round, two requests, two conversations of two
    turns): every server answers, the tables are there, and affinity keeps each conversation's later
    turns on the replica that holds its history (hits), which random routing cannot always do."""
    from draftwise.benchmark.suites import BenchSettings, replicas

    monkeypatch.setattr(replicas, "ROUNDS", 1)
    monkeypatch.setattr(replicas, "CONVERSATIONS", 2)
    monkeypatch.setattr(replicas, "TURNS", 2)
    monkeypatch.setattr(replicas, "SYSTEM", "Be brief. " * 3)  # (the tiny vocabulary spends a token a byte)
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("\n".join(json.dumps({"category": "code", "prompt": p})
                                 for p in ("def add(a, b):", "def quicksort(arr):")) + "\n")
    settings = BenchSettings(output=tmp_path / "out", model=str(tiny_qwen), datasets=(str(traffic),), max_tokens=8,
                             levels=(2,), requests=2, max_model_len=512, progress=False)
    report = replicas.run(settings)
    pooled, affinity = report.data["pooled"], report.data["affinity"]
    assert all(p["finished"] == p["requests"] == 2 and p["errors"] == 0 for p in pooled.values())
    assert pooled["1x1"]["speedup"] == 1.0 and pooled["2x1"]["speedup"] > 0
    assert all(a["answered"] == a["turns"] == 4 for a in affinity.values())
    assert affinity["affinity"]["hits"] > 0
    assert "prefix-cache hit rate" in report.markdown and "| 2x1 | 2 x 1 |" in report.markdown
    # where the CPU time went: each role found by its command line, the replicas' and the ingress's included
    assert "Where the machine's CPU time went" in report.markdown
    for run in report.data["runs"]["2x1"]:
        assert run["cpu"].get("engine replicas", 0) > 0 and "ingress" in run["cpu"], run["cpu"]
