"""A `Transformer` with no storage (the meta device), its parameters' random initialization skipped:
the loaders' shell, filled with the checkpoint's tensors or the packed-weight cache afterwards.

Skipping the initialization is not only time saved. On the meta device torch runs `normal_` and
`uniform_` through its Python references, and the first of those calls imports torch's compiler
(dynamo, inductor, Triton): ~190 MB resident in every process that loads a model, used by nothing
on the CPU path (the default target: 1,679 MiB resident after loading with it imported, 1,540 without;
`tests/test_unallocated.py` holds the CPU path to never importing it).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from torch.nn import init

from draftwise.model.config import ModelConfig
from draftwise.model.transformer import Transformer

# torch.nn.init's in-place fills, which the modules' reset_parameters call
_FILLS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
          "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "orthogonal_")
_LOCK = threading.Lock()  # (two loads at once, in a server's threads, must not restore each other's patch)
_SKIPPING = threading.local()  # set in the thread building a shell: only its fills are skipped


def unallocated_transformer(config: ModelConfig) -> Transformer:
    """The model's modules on the meta device, nothing initialized."""
    with _LOCK, _fills_skipped(), torch.device("meta"):
        return Transformer(config)


@contextmanager
def _fills_skipped():
    """torch.nn.init's fills skipped in this thread (another thread building a module meanwhile gets
    them as ever: the patch is process-wide, the skipping is not)."""
    saved = {name: getattr(init, name) for name in _FILLS if hasattr(init, name)}
    _SKIPPING.on = True
    try:
        for name, fill in saved.items():
            setattr(init, name, _skipped_here(fill))
        yield
    finally:
        _SKIPPING.on = False
        for name, fill in saved.items():
            setattr(init, name, fill)


def _skipped_here(fill):
    def maybe(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return tensor if getattr(_SKIPPING, "on", False) else fill(tensor, *args, **kwargs)
    return maybe
