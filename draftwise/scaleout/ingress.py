"""The HTTP entry of a replicated server: routes each request to one replica and passes its answer
through (streams chunk by chunk), answers /health per replica and /metrics for all.

Faults: a replica that fails before answering has the request retried on another (nothing was sent, so
nothing is lost or doubled); one that dies mid-stream ends that stream with an error event (never a
silent cut); either way it is marked down, skipped by routing, and probed until Ray Serve has
restarted it.

(No `from __future__ import annotations` here: FastAPI must see `Request` itself in the signatures of
the ingress's methods.)
"""


import asyncio
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from draftwise.scaleout.affinity import affinity_key
from draftwise.scaleout.metrics import IngressMetrics
from draftwise.scaleout.routing import NoReplicaError, Router
from draftwise.server.protocol import error_body
from draftwise.server.requests import DEFAULT_MAX_REQUEST_BYTES
from draftwise.server.security import api_keys, host_name, tenant_for

logger = logging.getLogger(__name__)

PROBE_SECONDS = 1.0  # how often replicas are asked whether they are up
PROBE_TIMEOUT = 5.0
REPLICA_HEADER = "x-draftwise-replica"  # which replica answered (responses carry it)
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "host"}

app = FastAPI(title="draftwise (replicated)", docs_url=None, redoc_url=None, openapi_url=None)


def stream_error_event(message: str) -> bytes:
    body = error_body(message, "server_error", code="replica_failed")
    return f"data: {json.dumps(body)}\n\n".encode()


async def limited_body(request: Request, limit: int) -> bytes | None:
    """The request's body, or None once it is known to exceed `limit` bytes (by its Content-Length, or
    while reading: the rest is never read)."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


class _Released(StreamingResponse):
    """A streamed answer whose `release` runs however the response ends: its body generator's own
    `finally` never runs when the response fails before the body starts (a client gone by then)."""

    def __init__(self, content, release, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
@serve.ingress(app)
class Ingress:
    def __init__(self, *replicas, replica_names: tuple[str, ...] = (), routing: str = "affinity",
                 api_key: str | tuple[str, ...] | None = None, allowed_hosts: tuple[str, ...] = ("*",),
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.replicas, self.replica_names = list(replicas), tuple(replica_names)
        self.allowed_hosts = frozenset(host.lower() for host in allowed_hosts)
        self.router = Router(len(self.replicas), routing)
        self.metrics = IngressMetrics()
        self.api_keys = [key.encode() for key in api_keys(api_key)]  # (encoded once, as tenant_for compares)
        self.max_request_bytes = max_request_bytes
        self.probe_timeout = PROBE_TIMEOUT  # (seconds a replica gets to answer a probe or a /metrics call)
        for index in range(len(self.replicas)):
            self.router.mark(index, False)  # (until a probe hears from it)
            self.metrics.up.labels(str(index)).set(0)
        self._prober = None
        self._last_status: list[dict | None] = [None] * len(self.replicas)  # what each replica said last
        self.draining = False

    # --- health ---------------------------------------------------------------------------
    async def _running(self) -> list[bool]:
        """Which replica deployments Ray Serve reports with a running replica. (Requests sent through
        a handle before its deployment has one wait in Ray Serve's router; probes cancelled there
        at their timeout stalled a fresh replica's first requests for minutes. So replicas are
        probed only once running.)"""
        def read() -> list[bool]:
            app = serve.status().applications.get(serve.get_replica_context().app_name)
            if app is None:
                return [False] * len(self.replicas)
            return [app.deployments.get(name) is not None
                    and app.deployments[name].replica_states.get("RUNNING", 0) > 0 for name in self.replica_names]

        try:
            return await asyncio.to_thread(read)
        except Exception:  # (the controller is busy or restarting: ask again next round)
            return [self.router.up[i] for i in range(len(self.replicas))]

    async def _probe(self, index: int, running: bool) -> dict | None:
        if not running:
            return None
        try:
            return await asyncio.wait_for(self.replicas[index].status.remote(), self.probe_timeout)
        except Exception:  # (dead, restarting, or too slow to answer)
            return None

    async def _probe_round(self) -> None:
        running = await self._running()
        results = await asyncio.gather(*(self._probe(i, running[i]) for i in range(len(self.replicas))))
        for index, status in enumerate(results):
            self._last_status[index] = status
            self._mark(index, status is not None and status["accepting"])

    async def _probe_forever(self) -> None:
        while True:
            await self._probe_round()
            await asyncio.sleep(PROBE_SECONDS)

    def _mark(self, index: int, up: bool) -> None:
        self.router.mark(index, up)
        self.metrics.up.labels(str(index)).set(1 if up else 0)

    async def _ensure_prober(self) -> None:
        """The probes run from the first request on (the first waits for one round)."""
        if self._prober is None:
            await self._probe_round()
        if self._prober is None or self._prober.done():
            self._prober = asyncio.get_running_loop().create_task(self._probe_forever())

    async def drain(self, timeout: float) -> int:
        """Refuse new requests (503, Retry-After; /health 503) and wait up to `timeout` seconds for
        the running ones to finish. Returns how many were still running."""
        self.draining = True
        deadline = asyncio.get_running_loop().time() + timeout
        while sum(self.router.outstanding) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return sum(self.router.outstanding)

    def _draining_response(self) -> Response:
        return JSONResponse(error_body("the server is shutting down", "server_error", code="server_shutting_down"),
                            status_code=503, headers={"Retry-After": "1"})

    @app.get("/health")
    async def health(self, request: Request):
        """200 with each replica's state (and process) while any is up; 503 when none is (or while
        starting or draining). From the probes every PROBE_SECONDS. (Host names checked as one server
        checks them; no key needed.)"""
        if (refusal := self._check_host(request)) is not None:
            return refusal
        await self._ensure_prober()
        replicas = {str(i): {"state": "up" if self.router.up[i] and s is not None else "down",
                             "pid": s["pid"] if s is not None else None} for i, s in enumerate(self._last_status)}
        up = any(r["state"] == "up" for r in replicas.values()) and not self.draining
        return JSONResponse({"status": "ok" if up else ("draining" if self.draining else "unavailable"),
                             "replicas": replicas},
                            status_code=200 if up else 503)

    @app.get("/metrics")
    async def prometheus(self, request: Request):
        if (refusal := self._check_key(request)) is not None:
            return refusal
        await self._ensure_prober()

        async def text_of(index: int) -> str | None:
            """The replica's metrics text; None from one that is down, slow, or answers anything else."""
            if not self.router.up[index]:  # (a call to a replica Ray is restarting waits for minutes)
                return None
            stream = self.replicas[index].options(stream=True).forward.remote("GET", "/metrics", "", [], b"")

            async def read() -> str | None:
                items = [item async for item in stream]
                if not items or not isinstance(items[0], dict) or items[0].get("status") != 200:
                    return None
                return b"".join(item for item in items if isinstance(item, bytes)).decode()

            try:
                return await asyncio.wait_for(read(), self.probe_timeout)
            except Exception:
                stream.cancel()
                return None

        texts = await asyncio.gather(*(text_of(i) for i in range(len(self.replicas))))
        body = self.metrics.render({i: t for i, t in enumerate(texts) if t is not None})
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    # --- everything else: one replica answers -----------------------------------------------
    def _check_host(self, request: Request) -> Response | None:
        """The Host allowlist, as one server checks it (its replicas take any Host)."""
        host = host_name(request.headers.get("host", ""))
        if "*" not in self.allowed_hosts and host not in self.allowed_hosts:
            return JSONResponse(error_body(f"Host {host!r} is not allowed here (allowed: "
                                           f"{', '.join(sorted(self.allowed_hosts))}); start the server with "
                                           "--allowed-hosts to add names", code="invalid_host"), status_code=400)
        return None

    def _check_key(self, request: Request) -> Response | None:
        """The Host allowlist and the API key, as one server checks them; the key's tenant is left in
        request.state.tenant for the replica."""
        if (refusal := self._check_host(request)) is not None or not self.api_keys:
            return refusal
        tenant = tenant_for(request.headers.get("authorization", ""), self.api_keys)
        if tenant is not None:
            request.state.tenant = tenant
            return None
        return JSONResponse(error_body("invalid or missing API key", "authentication_error", code="invalid_api_key"),
                            status_code=401, headers={"WWW-Authenticate": "Bearer"})

    # (every method: the replica answers what one server answers, a 405 included)
    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    async def forward(self, request: Request, path: str):
        if (refusal := self._check_key(request)) is not None:
            return refusal
        if self.draining:
            return self._draining_response()
        await self._ensure_prober()
        body = await limited_body(request, self.max_request_bytes)
        if body is None:  # (as one server answers it: nothing of it reaches a replica)
            return JSONResponse(error_body(f"the request body is larger than this server's limit of "
                                           f"{self.max_request_bytes} bytes", code="request_too_large"), status_code=413)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS]
        key = affinity_key(request.url.path, request.headers, body)
        tried: set[int] = set()
        while True:
            try:
                choice = self.router.choose(key, frozenset(tried))
            except NoReplicaError:
                return JSONResponse(error_body("no replica is available; retry later", "server_error",
                                               code="no_replica"), status_code=503, headers={"Retry-After": "1"})
            index = choice.replica
            self.metrics.routed.labels(str(index), choice.outcome).inc()
            stream = self.replicas[index].options(stream=True).forward.remote(
                request.method, request.url.path, request.url.query, headers, body,
                getattr(request.state, "tenant", None))
            try:
                head = await stream.__anext__()
                break
            except Exception as error:  # failed before answering: nothing sent, so try another replica
                logger.warning("replica %d failed before answering: %s", index, error)
                self.router.finished(index)
                self._mark(index, False)
                self.metrics.replica_failures.labels(str(index), "before_response").inc()
                tried.add(index)
            except BaseException:  # the client went away while the replica worked: its request is aborted
                stream.cancel()
                self.router.finished(index)
                raise
        response_headers = {k: v for k, v in head["headers"] if k.lower() not in _HOP_HEADERS}
        response_headers[REPLICA_HEADER] = str(index)
        event_stream = response_headers.get("content-type", "").startswith("text/event-stream")
        state = {"finished": False, "released": False}

        def release() -> None:
            """Once, however the response ended: the replica's request aborted unless it finished
            (a client gone: a disconnect there), its slot returned to the router."""
            if not state["released"]:
                state["released"] = True
                if not state["finished"]:
                    stream.cancel()
                self.router.finished(index)

        async def body_chunks():
            try:
                async for chunk in stream:
                    yield chunk
                state["finished"] = True
            except Exception as error:  # the replica died mid-answer
                state["finished"] = True
                logger.warning("replica %d failed mid-stream: %s", index, error)
                self._mark(index, False)
                self.metrics.replica_failures.labels(str(index), "mid_stream").inc()
                if event_stream:
                    yield stream_error_event(f"replica {index} failed while streaming: {type(error).__name__}")
            finally:
                release()

        return _Released(body_chunks(), release, status_code=head["status"], headers=response_headers)
