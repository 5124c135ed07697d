"""The AVX2 builds of the native kernels, tested on machines that would take the AVX-512 ones.

CI may run on either kind of CPU; so that both builds are tested wherever it runs, this runs the
kernel tests again in a process told to take the AVX2 builds (`DRAFTWISE_NATIVE_ISA=avx2`). On a
machine whose choice is already AVX2 the main run covers them, and this is skipped."""

import os
import subprocess
import sys

import pytest

from draftwise import native
from draftwise.cache import attention_backend
from draftwise.quant import native as quant_native

KERNEL_TESTS = ["tests/test_batch_invariance.py", "tests/test_paged_attention_tiles.py", "tests/test_int8_activations.py", "tests/test_layer_ops.py",
                "tests/test_quantization.py", "tests/test_avx2_build.py::test_the_isa_choice"]


def test_the_isa_choice(monkeypatch):
    """The first build whose flags the CPU has; the environment narrows it; none fits: a reason."""
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.delenv(native.ISA_ENV, raising=False)
    assert native.chosen(attention_backend.BUILDS).isa == "avx2"
    assert native.chosen(quant_native.BUILDS).isa == "avx2"
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw",
                                                                  "avx512vl", "avx512_bf16", "avx512_vnni"}))
    assert native.chosen(quant_native.BUILDS).isa == "avx512"
    monkeypatch.setenv(native.ISA_ENV, "avx2")
    assert native.chosen(quant_native.BUILDS).isa == "avx2"
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"sse4_2"}))
    monkeypatch.delenv(native.ISA_ENV)
    assert native.chosen(attention_backend.BUILDS) is None
    assert "the CPU has none of avx512" in native.unavailable_reason(attention_backend.BUILDS)


def test_the_kernel_tests_pass_with_the_avx2_builds():
    if os.environ.get(native.ISA_ENV) == "avx2":
        pytest.skip("this process already runs the AVX2 builds")
    if native.chosen(attention_backend.BUILDS) is None or native.chosen(attention_backend.BUILDS).isa == "avx2":
        pytest.skip("this machine's own choice is the AVX2 build (or none): the main run covers it")
    if not {"avx2", "fma", "f16c"} <= native.cpu_flags():
        pytest.skip("the CPU has no AVX2")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
                            capture_output=True, text=True, timeout=1500, env={**os.environ, native.ISA_ENV: "avx2"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
