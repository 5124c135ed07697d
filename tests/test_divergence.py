"""The op-naming tool: one token at a time vs k at a time, the first module whose output differs."""

import subprocess
import sys

import pytest
import torch

from draftwise import LLM
from draftwise.model.layers import RMSNorm
from draftwise.runner.divergence import first_divergence


@pytest.fixture(scope="module", params=["int4", "none"])
def llm(request, tiny_qwen):
    """The default CPU weights (int4, native kernels) and fp32 (oneDNN), both batch-invariant."""
    return LLM(str(tiny_qwen), max_model_len=128, max_num_seqs=2, progress=False, quantization=request.param)


def token_ids(llm):
    return llm.tokenizer.encode("def add(a, b):\n    return a + b\n" * 3)[:40]


@pytest.mark.parametrize("window", [2, 5, 8])
def test_the_cpu_path_is_bit_identical_at_every_window(llm, window):
    assert first_divergence(llm.runner, token_ids(llm), window) is None


def test_a_reduction_that_depends_on_the_rows_is_named(llm, monkeypatch):
    """An RMSNorm whose rounding depends on how many tokens share the call, as a batched GPU
    reduction's may: the tool names the first one that runs."""
    original = RMSNorm.forward

    def row_dependent(self, x):
        out = original(self, x)
        return out + 1e-6 * (x.shape[1] - 1)  # differs only when several tokens share the call

    monkeypatch.setattr(RMSNorm, "forward", row_dependent)
    found = first_divergence(llm.runner, token_ids(llm), 4)
    assert found is not None and found.module == "layers.0.input_layernorm" and found.position == 1
    assert "layers.0.input_layernorm differs first, at token 1" in found.describe()
    assert torch.isfinite(torch.tensor(found.max_abs_diff)) and found.differing_elements > 0


def test_the_command_reports_bit_identity(tiny_qwen):
    result = subprocess.run([sys.executable, "-m", "draftwise", "divergence", "--model", str(tiny_qwen), "--window",
                             "4", "--tokens", "16", "--quantization", "none"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("bit-identical: 16 tokens fed one at a time and 4 at a time (cpu, float32, none)")
