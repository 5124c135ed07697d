"""Which device and dtype an LLM runs on, from what the user asked for."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from draftwise.errors import InvalidParameterError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def pick_device(device: str | torch.device | None) -> torch.device:
    """`None` or "auto": CUDA when present, else the CPU."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidParameterError(f"device must be cpu, cuda, cuda:N or auto, got {device!r}") from None
    if chosen.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidParameterError(f"device {device!r}: no CUDA GPU here (this torch build "
                                        f"{'has no CUDA' if torch.version.cuda is None else 'finds no GPU'})")
        if chosen.index is not None and chosen.index >= torch.cuda.device_count():
            raise InvalidParameterError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA GPUs here")
    elif chosen.type != "cpu":
        raise InvalidParameterError(f"device must be cpu, cuda, cuda:N or auto, got {device!r}")
    return chosen


def use_device(device: torch.device) -> None:
    """Make a GPU this thread's current device, and keep cuBLAS's bf16/fp16 split-K reductions in
    fp32 (reduced in bf16, a row's sums round differently with the split the batch's shape picks;
    the split itself still varies with the shape, which `tests/test_cuda_row_invariance.py` checks)."""
    if device.type != "cuda":
        return
    if device.index is not None:
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


def on_device(device: torch.device):
    """A context in which CUDA work (Triton launches, streams, graph captures, which go to the
    thread's current GPU, not the tensors') goes to `device`; nothing on the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """`None` or "auto": bf16 on CUDA, fp32 on the CPU."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise InvalidParameterError(f"dtype must be one of {', '.join(map(str, DTYPES.values()))}, got {dtype}")
        return dtype
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise InvalidParameterError(f"dtype must be one of {', '.join(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[dtype]
