"""Which op breaks batch invariance: feed a sequence's tokens one at a time and k at a time, and
name the first module whose output differs.

Speculation is lossless bit for bit only if verifying k tokens computes what k one-token steps
compute. When it does not (a reduction whose order depends on how many rows share the call), the
first module, in execution order, whose output for some token differs between the two runs is the
op to fix. Both runs use the same model and weights through the runner, each in its own cache row:
run A feeds every token alone, run B feeds them in windows of `window` tokens (as a verification
pass does); every module's output is recorded per token position (forward hooks) and compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from draftwise.runner.model_runner import ModelRunner


@dataclass(frozen=True, slots=True)
class Divergence:
    module: str  # the module's name in the model ("layers.0.input_layernorm"; "" is the whole model)
    position: int  # the token position whose output differs first
    max_abs_diff: float
    differing_elements: int
    elements: int

    def describe(self) -> str:
        return (f"{self.module or 'the model'} differs first, at token {self.position}: "
                f"{self.differing_elements} of {self.elements} elements, max |diff| {self.max_abs_diff:.3g}")


class _Recorder:
    """Forward hooks that keep every module's output per token position (B = 1 row)."""

    def __init__(self, model: nn.Module) -> None:
        self.order: list[str] = []  # module names in the order they first ran
        self.outputs: dict[str, dict[int, torch.Tensor]] = {}  # module -> position -> output row
        self.positions: list[int] = []  # the token positions of the forward pass in progress
        self._handles = [module.register_forward_hook(self._hook(name)) for name, module in model.named_modules()
                         if name]

    def _hook(self, name: str):
        def record(module, inputs, output) -> None:
            if not isinstance(output, torch.Tensor):
                return
            rows = _rows_by_position(output, len(self.positions))
            if rows is None:
                return
            if name not in self.outputs:
                self.order.append(name)
                self.outputs[name] = {}
            for position, row in zip(self.positions, rows):
                self.outputs[name].setdefault(position, row.detach().clone())
        return record

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _rows_by_position(output: torch.Tensor, count: int) -> list[torch.Tensor] | None:
    """The output split per token: [1, S, ...] along S, or [S, ...] (picked rows, as the LM head
    gets them) along its first dim; None for anything else."""
    if output.dim() >= 2 and output.shape[0] == 1 and output.shape[1] == count:
        return list(output[0])
    if output.dim() >= 1 and output.shape[0] == count and count > 1:
        return list(output)
    if count == 1 and output.dim() >= 1 and output.shape[0] == 1:
        return [output[0]]
    return None


def first_divergence(runner: ModelRunner, token_ids: list[int], window: int,
                     prefix: int = 1) -> Divergence | None:
    """Feed `token_ids[:prefix]` once, then the rest one at a time (run A) and `window` at a time
    (run B); the first module whose output differs for some token, or None if all are identical."""
    if window < 2 or prefix < 1 or len(token_ids) <= prefix:
        raise ValueError("need window >= 2 and at least one token after a non-empty prefix")
    runs = []
    native_layers = getattr(runner.model, "native_layers", None)
    for step in (1, window):
        recorder = _Recorder(runner.model)
        row = runner.allocate()
        try:  # op by op: a native layer computes the same bits (tests/test_native_layers.py) but hides its ops
            if native_layers is not None:
                runner.model.native_layers = False
            runner.forward([row], [token_ids[:prefix]], [1])
            for start in range(prefix, len(token_ids), step):
                chunk = token_ids[start:start + step]
                recorder.positions = list(range(start, start + len(chunk)))
                runner.forward([row], [chunk], [len(chunk)])
                recorder.positions = []
        finally:
            if native_layers is not None:
                runner.model.native_layers = native_layers
            runner.free(row)
            recorder.remove()
        runs.append(recorder)
    single, windowed = runs
    for name in single.order:
        for position, expected in sorted(single.outputs[name].items()):
            got = windowed.outputs.get(name, {}).get(position)
            if got is None or got.shape != expected.shape:
                continue
            differs = got != expected
            if bool(differs.any()):
                diff = (got.float() - expected.float()).abs()
                return Divergence(name, position, float(diff.max()), int(differs.sum()), differs.numel())
    return None
