"""A count of the modules and tensors assigned inside decoder layers, so that what is built from a
layer's parts (its native form, `Transformer.native_layer`) is checked again only when some part
may have been replaced (quantization swaps linear layers; tests swap weights), not on every pass:
reading a layer's modules costs ~20 us a layer on a CPU whose caches a step's weights have just
flushed, ~0.5 ms of a 0.5B draft model's step."""

from __future__ import annotations

import torch
from torch import nn

_assignments = 0


def part_changes() -> int:
    """How many modules and tensors have been assigned to a `TracksPartChanges` module so far."""
    return _assignments


class TracksPartChanges(nn.Module):
    """An nn.Module whose module and tensor assignments are counted (`part_changes`)."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, (nn.Module, torch.Tensor)):
            global _assignments
            _assignments += 1
        super().__setattr__(name, value)
