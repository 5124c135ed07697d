"""Fake clocks, so that tests assert on logic, never on this machine's speed.

Each replaces the `time` module of the draftwise modules named (they read `time.perf_counter()`)."""

from __future__ import annotations

from types import SimpleNamespace


class TickingClock:
    """One second passes at every read: a duration counts the reads between its two ends."""

    def __init__(self, monkeypatch, *modules: str) -> None:
        self.now = 0.0
        for module in modules:
            monkeypatch.setattr(f"{module}.time", SimpleNamespace(perf_counter=self.read))

    def read(self) -> float:
        self.now += 1.0
        return self.now


class WorkClock:
    """Time passes only when a model runs: `cost(n)` seconds for a forward over n new tokens."""

    def __init__(self, monkeypatch, *modules: str, fixed: float = 0.010, per_token: float = 0.001) -> None:
        from draftwise.runner.model_runner import ModelRunner

        self.now, self.fixed, self.per_token = 0.0, fixed, per_token
        forward = ModelRunner.forward

        def ticking_forward(runner, rows, token_ids, *args, **kwargs):
            self.now += self.cost(sum(len(ids) for ids in token_ids))
            return forward(runner, rows, token_ids, *args, **kwargs)

        monkeypatch.setattr(ModelRunner, "forward", ticking_forward)
        for module in modules:
            monkeypatch.setattr(f"{module}.time", SimpleNamespace(perf_counter=lambda: self.now))

    def cost(self, num_tokens: int) -> float:
        return self.fixed + self.per_token * num_tokens
