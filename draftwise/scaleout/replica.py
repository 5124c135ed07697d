"""One engine replica: the whole `draftwise serve` app (its engine, validation, streaming, metrics)
built from the same arguments by `make_server` (the CLI's, handed down so that this layer needs no
CLI), called through ASGI by the ingress."""

from __future__ import annotations

import os


class EngineReplica:
    def __init__(self, make_server, serve_argv: list[str], threads: int, index: int) -> None:
        """make_server(argv) -> (ASGI app, AsyncEngine): `draftwise serve`'s server from its arguments."""
        import torch

        torch.set_num_threads(threads)
        self.index, self.threads = index, threads
        self.app, self.engine = make_server(serve_argv)

    async def forward(self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes,
                      tenant: str | None = None):
        """The response to one HTTP request: its status and headers, then its body as produced.
        tenant: the API key's, as the ingress found it (the replica's server checks no key)."""
        from draftwise.scaleout.asgi_call import call_asgi

        async for item in call_asgi(self.app, method, path, query, headers, body, {"tenant": tenant}):
            yield item

    async def status(self) -> dict:
        return {"replica": self.index, "pid": os.getpid(), "threads": self.threads, "accepting": self.engine.accepting}

    def check_health(self) -> None:
        """Ray Serve's periodic health check: a replica whose engine thread ended is restarted."""
        if not self.engine.running and self.engine.accepting:
            raise RuntimeError("the engine thread ended")

    def __del__(self) -> None:  # (Ray Serve stops a replica once its requests finished or its grace ran out)
        engine = getattr(self, "engine", None)
        if engine is not None and engine.running:
            engine.drain(0.0)
