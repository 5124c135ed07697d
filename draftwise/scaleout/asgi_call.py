"""Call an ASGI app in-process and hand its response back as it is produced: the status and headers
first, then each body chunk as the app sends it (so a stream stays a stream across Ray).

If the caller stops reading (its client went away), the app is told the client disconnected, which
the server answers by aborting the request, as it does for a real connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


async def call_asgi(app, method: str, path: str, query: str, headers: list[tuple[str, str]],
                    body: bytes, state: dict | None = None) -> AsyncIterator[dict | bytes]:
    """Yields {"status": int, "headers": [(name, value), ...]} once, then the body's chunks (bytes).
    state: the request's `request.state` as middleware would have set it (the API key's tenant)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": query.encode(),
             "headers": [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80), "state": dict(state or {})}
    messages: asyncio.Queue[dict | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    request_sent = False

    async def receive() -> dict:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": [(n.decode("latin-1"), v.decode("latin-1")) for n, v in message.get("headers", [])]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
    finally:
        disconnected.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
            except (asyncio.TimeoutError, Exception):
                task.cancel()
