"""Running the app under uvicorn with a graceful drain.

On SIGTERM (or the first Ctrl-C) the server keeps listening but stops admitting: new requests get
503 with Retry-After and /health turns 503; running and queued requests go on for up to
`drain_timeout` seconds; whatever is still open then ends with an error event (streams) or a 503
(bodies); then uvicorn closes. A second signal stops at once.
"""

from __future__ import annotations

import threading
import time

import uvicorn

from draftwise.server.async_engine import AsyncEngine

FLUSH_SECONDS = 0.5  # time for the last error events to reach their clients before uvicorn closes


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.drain_timeout = engine, drain_timeout
        self._draining = False

    def handle_exit(self, sig, frame) -> None:
        if self._draining:  # a second signal: stop now
            self.force_exit = True
            self.should_exit = True
            return
        self._draining = True
        threading.Thread(target=self._drain, name="draftwise-drain", daemon=True).start()

    def _drain(self) -> None:
        self.engine.drain(self.drain_timeout)
        time.sleep(FLUSH_SECONDS)
        self.should_exit = True


def serve(app, engine: AsyncEngine, host: str, port: int, drain_timeout: float, log_level: str = "warning") -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    DrainingServer(config, engine, drain_timeout).run()
