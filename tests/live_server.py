"""A real uvicorn server (with the graceful drain) serving the app on a free loopback port, in a
thread; and a streaming reader for tests that must watch a stream while doing something else."""

from __future__ import annotations

import signal
import socket
import threading
import time

import httpx
import uvicorn

from draftwise.server.app import ServerOptions, build_app
from draftwise.server.async_engine import AsyncEngine
from draftwise.server.serving import DrainingServer


class LiveServer:
    def __init__(self, llm, model: str, options: ServerOptions = ServerOptions()) -> None:
        self.llm, self.engine = llm, AsyncEngine(llm)
        app = build_app(self.engine, model, options)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = DrainingServer(config, self.engine, options.drain_timeout)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "unused"):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def sigterm(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self) -> None:
        self.sigterm()
        self.thread.join(timeout=60)


class StreamReader:
    """Reads one streamed completion in a thread; `lines` holds its non-empty lines so far."""

    def __init__(self, url: str, body: dict) -> None:
        self.lines: list[str] = []
        self.streaming = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url, body))
        self.thread.start()
        assert self.streaming.wait(timeout=30), "the stream did not start"

    def _read(self, url: str, body: dict) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line:
                    self.lines.append(line)
                    self.streaming.set()

    def join(self) -> list[str]:
        self.thread.join(timeout=120)
        return self.lines


def settled(llm, seconds: float = 20.0) -> dict:
    """The engine's stats once nothing runs, waits or holds a KV block (or after `seconds`)."""
    deadline = time.time() + seconds
    while True:
        stats = llm.engine_stats()
        if (stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_in_use"] == 0) or time.time() > deadline:
            return stats
        time.sleep(0.05)
