"""The Triton silu(gate) * up (the GPU's): against torch's ops and for row independence, in Triton's
interpreter on the CPU (fp32: the interpreter has no bf16) and on CUDA where there is one, where
SwiGLU takes it."""

import textwrap

import pytest
import torch

from tests.triton_checks import run_check

pytest.importorskip("triton")

CHECK = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from draftwise.model.layers import SwiGLU
    from draftwise.model.triton_silu_mul import BLOCK, silu_mul
    device, dtype = "{device}", getattr(torch, "{dtype}")
    torch.manual_seed(0)
    intermediate = BLOCK + 300  # a program's block and a part of one
    gate_up = (4 * torch.randn(3, 5, 2 * intermediate, device=device)).to(dtype)
    together = silu_mul(gate_up)
    gate, up = gate_up.split(intermediate, dim=-1)
    reference = F.silu(gate) * up
    scale = float(reference.float().abs().max())
    worst = float((together.float() - reference.float()).abs().max()) / scale
    assert together.shape == (3, 5, intermediate) and worst < (1e-6 if dtype == torch.float32 else 1e-2), worst
    for b, s in ((0, 0), (1, 3), (2, 4)):
        assert torch.equal(silu_mul(gate_up[b:b + 1, s:s + 1]), together[b:b + 1, s:s + 1]), (b, s)
    if device == "cuda":  # the module takes the kernel on CUDA
        mlp = SwiGLU(64, 96).to(device, dtype)
        x = torch.randn(2, 3, 64, device=device).to(dtype)
        assert torch.equal(mlp(x), mlp.down_proj(silu_mul(mlp.gate_up_proj(x))))
    print("ok", worst)
""")



def test_the_triton_silu_mul_in_the_interpreter():
    run_check(CHECK, interpreted=True, device="cpu", dtype="float32")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_triton_silu_mul_on_cuda(dtype):
    run_check(CHECK, interpreted=False, device="cuda", dtype=dtype)
