"""A seeded LLM's own random stream (`LLM(seed=...)`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class RandomStream:
    """The draws of a seeded LLM's steps (sampling, drafting, rejection sampling all use torch's
    default generators), kept apart from the process's: each step runs on the stream where this
    LLM's previous step left it, so that two LLMs built with the same seed give the same tokens for
    the same calls whatever ran in between (another LLM's steps, a drafter's build that seeds the
    generators). Two get/set pairs of generator state a step: no device sync."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            # (this LLM's generators alone: torch.manual_seed would reseed every GPU's, for good)
            torch.random.default_generator.manual_seed(seed)
            if device.type == "cuda":
                with torch.cuda.device(device):
                    torch.cuda.manual_seed(seed)
            self.states = self._states()

    @contextmanager
    def drawing(self) -> Iterator[None]:
        outside = self._states()
        self._set_states(self.states)
        try:
            yield
        finally:
            self.states = self._states()
            self._set_states(outside)

    def _states(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None

    def _set_states(self, states: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        cpu, cuda = states
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)
