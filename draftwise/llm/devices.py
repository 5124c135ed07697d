"""Which device and dtype an LLM runs on, from what the user asked for."""

from __future__ import annotations

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
