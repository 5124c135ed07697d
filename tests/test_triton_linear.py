"""The Triton linear layer (float32 on the GPU): against torch's product and for row independence (a
row's output alone equals its output among others, bit for bit), in Triton's interpreter on the CPU
and on CUDA where there is one; and a float32 CUDA model takes it for every linear layer."""

import textwrap

import pytest
import torch

from tests.triton_checks import run_check

pytest.importorskip("triton")

CHECK = textwrap.dedent("""
    import torch
    from draftwise.model.triton_linear import invariant_linear
    device = "{device}"
    torch.manual_seed(0)
    weight = torch.randn(200, 96, device=device)  # N = 200: not a multiple of the tile
    weight = weight[:, :90]  # K = 90, and rows with a stride of their own
    bias = torch.randn(200, device=device)
    x = torch.randn(70, 90, device=device)
    together = invariant_linear(x, weight, bias)
    reference = (x.double() @ weight.double().T + bias.double()).float()
    worst = float((together - reference).abs().max())
    assert worst < 1e-4, worst
    if not {row_invariant}:  # (the interpreter's tl.dot is numpy's matmul: see numpy_matmul_is_row_invariant)
        print("ok", worst, "(row independence not checkable here)")
        raise SystemExit
    for rows in (1, 2, 5, 16, 17, 33):
        for start in (0, 3, 70 - rows):
            assert torch.equal(invariant_linear(x[start:start + rows], weight, bias), together[start:start + rows]), \\
                (rows, start)
    three = invariant_linear(x[:6].view(2, 3, 90), weight, bias)
    assert three.shape == (2, 3, 200) and torch.equal(three.view(6, 200), together[:6])
    print("ok", worst)
""")



def numpy_matmul_is_row_invariant() -> bool:
    """Whether numpy's matmul gives a row the same bits wherever it sits in a tile. Triton's interpreter
    computes tl.dot with it, so where it does not (OpenBLAS's Haswell kernels on an AVX2-only EPYC:
    10 of 16 places differ) the interpreter cannot show the kernel's row independence, only its
    accuracy; on a GPU the tile's instructions are the same for every row."""
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((16, 32), dtype=np.float32), rng.standard_normal((32, 64), dtype=np.float32)
    whole = a @ b
    for place in range(16):
        alone = np.zeros_like(a)
        alone[place] = a[3]
        if not np.array_equal((alone @ b)[place], whole[3]):
            return False
    return True


def test_the_triton_linear_in_the_interpreter():
    run_check(CHECK, interpreted=True, device="cpu", row_invariant=numpy_matmul_is_row_invariant())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_triton_linear_on_cuda():
    run_check(CHECK, interpreted=False, device="cuda", row_invariant=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_float32_cuda_model_takes_it_for_every_linear_layer(tiny_qwen):
    from torch import nn

    from draftwise.loading.hf_folder import load_model
    from draftwise.model.triton_linear import InvariantLinear

    fp32 = load_model(tiny_qwen, "cuda", torch.float32, quantization="none")
    assert not any(type(m) is nn.Linear for m in fp32.modules())
    assert sum(type(m) is InvariantLinear for m in fp32.modules()) == 4 * fp32.config.num_hidden_layers + 1
    bf16 = load_model(tiny_qwen, "cuda", torch.bfloat16, quantization="none")
    assert not any(type(m) is InvariantLinear for m in bf16.modules())
