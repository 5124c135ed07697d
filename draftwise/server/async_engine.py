"""The engine behind the server: one background thread steps the `LLM`; handlers await outputs.

Handlers never touch the LLM: they post to the engine thread's inbox (add a request, abort one)
and await what it sends back. Between steps the thread drains the inbox, so requests join the
running batch as they arrive, and one whose client went away is aborted before the next step,
which frees its KV blocks at once. A request that fails inside a step ends alone (its last output
has finish_reason "error"); if the step loop itself breaks, every open stream gets the error.

Draining (`drain`): new requests are refused (`EngineDraining`: 503 with Retry-After), running and
queued ones go on until they finish or the timeout passes; then the rest end with `EngineStopped`,
which a stream turns into an error event, never a silent cut.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from draftwise.engine.outputs import RequestOutput
from draftwise.errors import DraftwiseError
from draftwise.llm import LLM
from draftwise.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


class EngineStopped(DraftwiseError):
    """The server stopped before the request finished."""


class EngineDraining(EngineStopped):
    """The server is shutting down and takes no new requests."""


_ADMITTED = object()  # first item of a stream: the request passed validation and is queued


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_id: str | None = None

    def send(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, llm: LLM, on_change: Callable[[dict], None] | None = None) -> None:
        self.llm = llm
        self.on_change = on_change  # called on the engine thread with `llm.engine_stats()` after every change
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # key -> stream (engine thread only)
        self._accepting = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draftwise-engine", daemon=True)
        self._thread.start()

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def running(self) -> bool:
        """Whether the engine thread is alive."""
        return self._thread.is_alive()

    # --- handlers' side ---------------------------------------------------------------------
    async def generate(self, prompt, params: SamplingParams, **options) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it runs (each with the text delta since the previous one);
        the last one is finished. Bad input raises before the first output. Leaving the loop
        early aborts the request."""
        if not self._accepting:
            raise EngineDraining("the server is shutting down; retry on another replica or later")
        key = uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop())
        self._post(("add", key, stream, prompt, params, options))
        finished = False
        try:
            first = await stream.queue.get()
            if isinstance(first, BaseException):
                finished = True  # never admitted: nothing to abort
                raise first
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._post(("abort", key))

    def drain(self, timeout: float) -> None:
        """Refuse new requests, let admitted ones finish for up to `timeout` seconds, end the rest
        with `EngineStopped`, and stop the engine thread."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (self._streams or not self._inbox.empty()):
            time.sleep(0.05)
        self._post(("stop",))
        self._thread.join(timeout=30)

    def shutdown(self, grace_seconds: float = 10.0) -> None:
        self.drain(grace_seconds)

    def _post(self, message: tuple) -> None:
        self._inbox.put(message)
        self._wake.set()

    # --- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if self._drain_inbox():
                self._changed()
            if self._stop.is_set():
                break
            if not self.llm.has_unfinished_requests():
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                outputs = self.llm.step()
            except Exception as error:  # the step loop itself broke: never leave a client hanging
                logger.exception("the engine step failed outside any one request")
                self._end_all(EngineStopped(f"the engine failed: {type(error).__name__}: {error}"))
                continue
            self._deliver(outputs)
            self._changed()
        self._end_all(EngineStopped("the server shut down before this request finished"))
        self._changed()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_request = {stream.request_id: key for key, stream in self._streams.items()}
        for output in outputs:
            key = by_request.get(output.request_id)
            if key is None:
                continue
            stream = self._streams[key]
            if output.finished:
                del self._streams[key]
            stream.send(output)

    def _drain_inbox(self) -> bool:
        """Carry out what handlers posted; whether anything changed."""
        changed = False
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return changed
            changed = True
            if message[0] == "add":
                _, key, stream, prompt, params, options = message
                try:
                    stream.request_id = self.llm.add_request(prompt, params, **options)
                except Exception as error:  # bad input: the handler turns it into a 4xx
                    stream.send(error)
                    continue
                self._streams[key] = stream
                stream.send(_ADMITTED)
            elif message[0] == "abort":
                stream = self._streams.pop(message[1], None)
                if stream is not None:
                    self.llm.abort_request(stream.request_id)
            elif message[0] == "stop":
                self._stop.set()

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change(self.llm.engine_stats())
            except Exception:  # metrics must never stop the engine
                logger.exception("updating metrics failed")

    def _end_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            self.llm.abort_request(stream.request_id)
            stream.send(error)
        self._streams.clear()
