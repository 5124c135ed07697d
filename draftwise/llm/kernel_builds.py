"""The native CPU kernels compiled ahead, side by side, while the model is fetched and loaded.

Each kernel family (`draftwise.native`) compiles on first use, ~40-50 s apiece on a 2-core machine
(mostly PyTorch's headers): on a fresh machine or after an upgrade of PyTorch the four an LLM uses
took ~3.5 minutes, one after another, with nothing on the screen. Started here, each in a process
of its own, they run together and beside fetching and converting the model, and one line says so.
A family that fails to compile here is tried again, and its failure logged, where it is first used.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field

from draftwise import native
from draftwise.cache import attention_backend
from draftwise.model import native_decoder, native_layer_ops
from draftwise.quant import native as quant_native

# family -> (module, the cached function that builds and loads it, its builds)
FAMILIES = {
    "lowbit": (quant_native.__name__, "kernels", quant_native.BUILDS),
    "amx_prompt": (quant_native.__name__, "amx_kernels", quant_native.AMX_BUILDS),  # (AMX CPUs only)
    "attention": (attention_backend.__name__, "native_kernels", attention_backend.BUILDS),
    "layer_ops": (native_layer_ops.__name__, "layer_ops", native_layer_ops.BUILDS),
    "decoder_layer": (native_decoder.__name__, "decoder_module", native_decoder.BUILDS),
}


@dataclass
class KernelBuilds:
    """The compilations under way (none where every family is built or loaded already)."""
    families: list[str] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    progress: bool = True

    def wait(self) -> None:
        """Until every compilation has ended (each one's failure is left to its first use)."""
        failed = [family for family, process in zip(self.families, self.processes) if process.wait() != 0]
        if self.processes and self.progress:
            print(f"native kernels compiled in {time.monotonic() - self.started:.0f} s"
                  + (f" ({', '.join(failed)} failed: tried again at first use)" if failed else ""),
                  file=sys.stderr, flush=True)
        self.processes = []


def start_kernel_builds(device_type: str, progress: bool = True) -> KernelBuilds:
    """Start compiling, each in its own process, the families a CPU model will use that are neither
    loaded in this process nor in the cache."""
    builds = KernelBuilds(progress=progress)
    if device_type != "cpu":
        return builds
    for family, (module_name, getter, family_builds) in FAMILIES.items():
        loaded = getattr(sys.modules[module_name], getter).cache_info().currsize > 0
        if not loaded and native.needs_compiling(family, family_builds):
            builds.families.append(family)
    if not builds.families:
        return builds
    if progress:
        print(f"compiling draftwise's native kernels for this CPU ({', '.join(builds.families)}; once per machine "
              f"and PyTorch version, a few minutes, beside the model's loading)", file=sys.stderr, flush=True)
    for family in builds.families:
        module_name, getter, _ = FAMILIES[family]
        builds.processes.append(subprocess.Popen([sys.executable, "-c", compile_command(module_name, getter)],
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return builds


def compile_command(module_name: str, getter: str) -> str:
    """Python code that compiles (and loads) one family, as its first use would."""
    return f"import {module_name} as m; m.{getter}()"
