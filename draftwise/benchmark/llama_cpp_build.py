"""llama.cpp's benchmark tools, built here for `--peers llama.cpp`: from the pinned llama-cpp-python
sdist (which vendors llama.cpp's sources) into draftwise's cache, once per version, with a progress
line; later runs reuse the binaries.

Only two targets are built: `llama-bench` (plain decoding and forward passes over n tokens) and
`llama-speculative-simple` (its draft-model speculation), Release, `GGML_NATIVE` (the instructions
of this CPU, as a user building llama.cpp here gets), static, no network code, no server, no tests.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from draftwise.paths import cache_root

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendored llama.cpp is built
TARGETS = ("llama-bench", "llama-speculative-simple")
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF")


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp cannot be built here; the message says why (shown in the peer's table row)."""


def build_folder() -> Path:
    return cache_root() / "peers" / f"llama.cpp-{LLAMA_CPP_PYTHON}"


def llama_cpp_binaries(progress=print) -> dict[str, Path]:
    """Target name -> its binary, building them first if the cache lacks one."""
    folder = build_folder()
    binaries = {target: folder / "bin" / target for target in TARGETS}
    if all(path.is_file() for path in binaries.values()):
        return binaries
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise LlamaCppUnavailable(f"building llama.cpp needs {' and '.join(missing)} (pip install cmake; "
                                  f"apt install g++)")
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another bench may be building it right now
        if not all(path.is_file() for path in binaries.values()):
            _build(folder, binaries, progress)
    return binaries


def _build(folder: Path, binaries: dict[str, Path], progress) -> None:
    sources = folder / "src"
    if not (sources / "CMakeLists.txt").is_file():
        _unpack_vendored_sources(_download_sdist(folder, progress), sources)
    threads = os.cpu_count() or 1
    log = folder / "build.log"
    progress(f"building llama.cpp from llama-cpp-python {LLAMA_CPP_PYTHON} ({', '.join(TARGETS)}; {threads} "
             f"threads, a few minutes, once; log: {log})")
    with open(log, "w") as out:
        for command in (["cmake", "-S", str(sources), "-B", str(folder / "build"), *CMAKE_OPTIONS],
                        ["cmake", "--build", str(folder / "build"), "--target", *TARGETS, "-j", str(threads)]):
            if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                tail = log.read_text(errors="replace").splitlines()[-15:]
                raise LlamaCppUnavailable(f"building llama.cpp failed ({' '.join(command[:2])}); the end of "
                                          f"{log}:\n" + "\n".join(tail))
    (folder / "bin").mkdir(exist_ok=True)
    for target, path in binaries.items():
        built = folder / "build" / "bin" / target
        if not built.is_file():
            raise LlamaCppUnavailable(f"llama.cpp's build made no {target} (see {log})")
        shutil.copy2(built, path)
    shutil.rmtree(folder / "build", ignore_errors=True)
    progress(f"llama.cpp built: {folder / 'bin'}")


def _download_sdist(folder: Path, progress) -> Path:
    """The sdist, by pip (so the index, proxy and certificates configured for pip apply)."""
    found = sorted(folder.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"))
    if found:
        return found[0]
    progress(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist (about 75 MB)")
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                           f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(folder)],
                          capture_output=True, text=True)
    found = sorted(folder.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"))
    if done.returncode != 0 or not found:
        raise LlamaCppUnavailable(f"pip could not download the llama-cpp-python {LLAMA_CPP_PYTHON} sdist: "
                                  f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return found[0]


def _unpack_vendored_sources(sdist: Path, sources: Path) -> None:
    """vendor/llama.cpp of the sdist into `sources`."""
    staging = sources.with_name("src.part")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(sdist) as archive:
        prefix = f"{archive.getnames()[0].split('/')[0]}/vendor/llama.cpp/"
        members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
        for member in members:
            member.name = member.name[len(prefix):]
        archive.extractall(staging, members=[m for m in members if m.name], filter="data")
    shutil.rmtree(sources, ignore_errors=True)
    staging.replace(sources)
