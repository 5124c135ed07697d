"""Building draftwise's native CPU kernels: C++ sources compiled with PyTorch's extension builder on
first use (about a minute, once per machine, source and PyTorch version), kept in the cache.

A kernel family comes in builds, one per instruction set (`Build`: AVX-512 first, then AVX2); the
first whose CPU flags this machine has is the one used. The builds of a family compute the same
things but round differently, so a process uses one build for every pass (batch invariance holds
within a build; its digest names it wherever results are cached). Where no build fits, the
compiler is missing or DRAFTWISE_NATIVE_KERNELS=0, `build` returns None and callers fall back to
PyTorch's ops. DRAFTWISE_NATIVE_ISA=avx2 takes the AVX2 builds on an AVX-512 machine (to compare
or test them).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from draftwise.paths import cache_root

NATIVE_ENV = "DRAFTWISE_NATIVE_KERNELS"
ISA_ENV = "DRAFTWISE_NATIVE_ISA"

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Build:
    """One way to compile a kernel family: its sources, for CPUs with `required_flags`."""
    isa: str  # "avx512", "avx2"
    sources: tuple[Path, ...]
    flags: tuple[str, ...]  # compiler flags
    required_flags: tuple[str, ...]  # as /proc/cpuinfo names them
    headers: tuple[Path, ...] = ()  # included by the sources (part of what names the build)

    def digest(self) -> str:
        """Names a build: its sources, headers and compiler flags."""
        return source_digest([*self.sources, *self.headers], list(self.flags))


@cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def chosen(builds: tuple[Build, ...]) -> Build | None:
    """The first build this CPU can run (DRAFTWISE_NATIVE_ISA narrows the choice), or None."""
    wanted = os.environ.get(ISA_ENV)
    for candidate in builds:
        if wanted and candidate.isa != wanted:
            continue
        if all(flag in cpu_flags() for flag in candidate.required_flags):
            return candidate
    return None


def unavailable_reason(builds: tuple[Build, ...]) -> str | None:
    """Why none of these builds can be used here, or None if one can be built."""
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return f"turned off by {NATIVE_ENV}=0"
    if chosen(builds) is None:
        needs = " or ".join(f"{b.isa} ({', '.join(b.required_flags)})" for b in builds)
        return f"the CPU has none of {needs}" + (f" ({ISA_ENV}={os.environ[ISA_ENV]})" if os.environ.get(ISA_ENV) else "")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (install g++)"
    return None


def chosen_digest(builds: tuple[Build, ...]) -> str:
    """Names the build this machine uses ("none" where none is): caches of results key on it."""
    if unavailable_reason(builds) is not None:
        return "none"
    return chosen(builds).digest()


def source_digest(sources: list[Path], flags: list[str]) -> str:
    """Names a build: its sources and its compiler flags."""
    return hashlib.sha256(b"".join(source.read_bytes() for source in sources) + " ".join(flags).encode()).hexdigest()[:12]


def build(family: str, builds: tuple[Build, ...]):
    """The compiled extension module of the build this machine takes, or None where none can be had (logged)."""
    reason = unavailable_reason(builds)
    if reason is not None:
        log.info("native %s kernels not used: %s", family, reason)
        return None
    return compile_build(family, chosen(builds))


def build_folder(family: str, which: Build) -> Path:
    """Where a build's objects and extension go: one folder per family, ISA, sources, PyTorch and
    Python (an extension built for one Python fails to import in another: two environments sharing
    the cache would otherwise lose the kernels, silently)."""
    version = torch.__version__.replace("+", "-")
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return cache_root() / "kernels" / f"{family}-{which.isa}-{which.digest()}-torch{version}-{python}"


def extension_name(family: str, which: Build) -> str:
    """The compiled module's name (its file in `build_folder` is this name + ".so")."""
    return f"draftwise_{family}_{which.isa}_{which.digest()}"


def needs_compiling(family: str, builds: tuple[Build, ...]) -> bool:
    """Whether the build this machine takes is yet to be compiled here (False where none can be had)."""
    if unavailable_reason(builds) is not None:
        return False
    which = chosen(builds)
    return not (build_folder(family, which) / f"{extension_name(family, which)}.so").exists()


def compile_build(family: str, which: Build):
    """One build compiled (or loaded from the cache), whatever this machine would choose; None if it fails."""
    from torch.utils import cpp_extension

    folder = build_folder(family, which)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with builder_lock(folder):
            return cpp_extension.load(name=extension_name(family, which),
                                      sources=[str(source) for source in which.sources],
                                      extra_cflags=list(which.flags), extra_ldflags=["-fopenmp"],
                                      build_directory=str(folder), verbose=False)
    except Exception as error:  # a failed build must not stop the engine: PyTorch's ops remain
        log.warning("native %s kernels (%s) failed to build, using PyTorch's: %s", family, which.isa,
                    str(error).splitlines()[0])
        return None


@contextmanager
def builder_lock(folder: Path):
    """One process at a time compiles or loads a build folder, under a lock the system lets go of
    when its holder dies. PyTorch's builder marks its own turn with a file, `lock`, which it removes
    when done and waits on for ever while it exists: a process killed while compiling left one, and
    every later start hung before its first request. Holding this lock, any such file is a dead
    builder's, and is removed."""
    with open(folder / "builder.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"
            if stale.exists():
                log.warning("removing %s, left by a kernel build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
