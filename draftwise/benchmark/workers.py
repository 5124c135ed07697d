"""Contestants in worker processes of their own (spawn context); `runner` says why.

A worker builds its recipe, answers with its pid and the names of what it built, then serves calls
one at a time: the parent sends `(index, method, args)`, waits for `("ok", value)` or `("error",
exception, traceback)`, and pauses briefly before the next call. `None` ends a worker. Workers
ignore Ctrl-C: the parent stops them.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

from draftwise.errors import DraftwiseError

# After its last parallel region an OpenMP thread spins a few milliseconds before it sleeps (libgomp's
# default wait policy); the parent waits this long after each answer, so that a worker's spinning
# threads never overlap the next item, which may run in another worker.
SETTLE_SECONDS = 0.02


class Worker:
    def __init__(self, recipe: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(recipe, child), daemon=True)
        self.process.start()
        child.close()
        self.pid, described = self._receive()  # waits until the recipe is built
        self.contestants = [RemoteContestant(self, index, name, reference)
                            for index, (name, reference) in enumerate(described)]

    def call(self, index: int, method: str, *args: Any) -> Any:
        self._conn.send((index, method, args))
        try:
            return self._receive()
        finally:
            time.sleep(SETTLE_SECONDS)

    def _receive(self) -> Any:
        try:
            message = self._conn.recv()
        except EOFError:
            self.process.join(timeout=5)
            raise RuntimeError(f"benchmark worker {self.process.pid} died "
                               f"(exit code {self.process.exitcode})") from None
        if message[0] == "ok":
            return message[1]
        _, error, text = message
        if isinstance(error, DraftwiseError):
            raise error  # the CLI prints these as one line
        raise RuntimeError(f"in benchmark worker {self.process.pid}:\n{text}")

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self.process.join(timeout=30)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join()
        self._conn.close()


@dataclass(slots=True)
class RemoteContestant:
    """A contestant living in `worker`: the same `warm_up` and `run`, answered across the pipe."""
    worker: Worker
    index: int
    name: str
    reference: str

    @property
    def pid(self) -> int:
        return self.worker.pid

    def warm_up(self, prompt: str) -> None:
        self.worker.call(self.index, "warm_up", prompt)

    def run(self, item: Any) -> Any:
        return self.worker.call(self.index, "run", item)


def _serve(recipe: Any, conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        contestants = recipe.build()
        conn.send(("ok", (os.getpid(), [(c.name, c.reference) for c in contestants])))
    except BaseException as error:
        _send_error(conn, error)
        return
    while (message := conn.recv()) is not None:
        index, method, args = message
        try:
            conn.send(("ok", getattr(contestants[index], method)(*args)))
        except Exception as error:
            _send_error(conn, error)


def _send_error(conn, error: BaseException) -> None:
    text = traceback.format_exc()
    try:
        conn.send(("error", error, text))
    except Exception:  # an exception that does not pickle
        conn.send(("error", None, text))
