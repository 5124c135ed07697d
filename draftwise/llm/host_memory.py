"""Handing memory the engine freed back to the system.

Loading a model allocates and frees gigabytes (float weights read, quantized, let go). glibc's
malloc keeps much of what is freed on its heap (once large blocks have been freed, its dynamic mmap
threshold rises and later large blocks come from the heap too), so a process that installs a
draft model again and again (the planner's validation rounds, a benchmark's configs,
`LLM.set_speculative` in a long-lived program) grew with every install although nothing stayed
alive: the 1.5B with the 0.5B draft model installed six times went from 2.14 to 3.53 GiB resident
(AMD EPYC, 2026-11-27); with the heap trimmed after each install it stayed at 2.22 GiB.
`malloc_trim(0)` returns the heap's free pages; elsewhere (no glibc) nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from functools import cache


@cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Collect unreachable objects, then give the heap's free pages back to the system."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def resident_bytes() -> int:
    """This process's resident memory now (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
