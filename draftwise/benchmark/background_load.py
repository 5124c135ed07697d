"""Busy processes beside a benchmark run, from a given point of it to its end.

The controller issue's third scenario: the machine gets busy halfway through a run, and adaptive
speculation must notice (its live costs move) rather than keep buying drafts at quiet prices.
`draftwise bench --background-load 2@0.5` starts two processes that spin in a Python loop when the
run reaches half of its items, and ends them when the run ends. Items are started at item
boundaries, so every contestant runs a given item under the same load (the runner interleaves
contestants item by item), which is what makes the ratios of such a run comparable at all."""

from __future__ import annotations

import multiprocessing

from draftwise.errors import InvalidParameterError


def _spin() -> None:
    while True:
        pass


class BackgroundLoad:
    def __init__(self, processes: int, start_fraction: float) -> None:
        if processes < 1 or not 0.0 <= start_fraction < 1.0:
            raise InvalidParameterError(f"background load needs >= 1 process and a start in [0, 1), got "
                                        f"{processes}@{start_fraction}")
        self.processes = processes
        self.start_fraction = start_fraction
        self._running: list[multiprocessing.Process] = []
        self.started_at_item: int | None = None

    @classmethod
    def parse(cls, text: str) -> "BackgroundLoad":
        """'N@F': N busy processes from fraction F of the run's items (F = 0: from the start)."""
        count, _, start = text.partition("@")
        try:
            return cls(int(count), float(start or 0.0))
        except ValueError:
            raise InvalidParameterError(f"--background-load takes N@FRACTION (e.g. 2@0.5), got {text!r}") from None

    def before_item(self, index: int, total: int) -> None:
        """Start the processes once the run reaches its start fraction."""
        if self.started_at_item is None and index >= self.start_fraction * total:
            context = multiprocessing.get_context("spawn")
            self._running = [context.Process(target=_spin, daemon=True) for _ in range(self.processes)]
            for process in self._running:
                process.start()
            self.started_at_item = index

    def stop(self) -> None:
        for process in self._running:
            process.terminate()
        for process in self._running:
            process.join(timeout=5)
        self._running = []

    def describe(self) -> str:
        return (f"{self.processes} busy process(es) running from item {self.started_at_item}"
                if self.started_at_item is not None else f"{self.processes} busy process(es), never started")
