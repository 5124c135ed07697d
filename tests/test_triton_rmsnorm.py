"""The Triton RMSNorm (the GPU's), alone and with the residual add before it: against the torch path
and for batch invariance (a row's output alone equals its output among others), in Triton's
interpreter on the CPU (fp32: the interpreter has no bf16) and on CUDA where there is one (bf16 and
fp32)."""

import textwrap

import pytest
import torch

from tests.triton_checks import run_check

pytest.importorskip("triton")

CHECK = textwrap.dedent("""
    import torch
    from draftwise.model.layers import RMSNorm
    from draftwise.model.triton_rmsnorm import add_rms_norm, rms_norm
    device, dtype = "{device}", getattr(torch, "{dtype}")
    torch.manual_seed(0)
    norm = RMSNorm(1536, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(1536))
    norm = norm.to(device, dtype)
    x = (3 * torch.randn(6, 9, 1536)).to(device, dtype)
    together = rms_norm(x, norm.weight, norm.eps)
    x32 = x.float()
    reference = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)).to(dtype)
    worst = float((together.float() - reference.float()).abs().max())
    assert worst < (1e-5 if dtype == torch.float32 else 0.05), worst
    for r in range(6):
        for s in (0, 4, 8):
            assert torch.equal(rms_norm(x[r:r + 1, s:s + 1], norm.weight, norm.eps), together[r:r + 1, s:s + 1]), (r, s)
            assert torch.equal(rms_norm(x[r:r + 1, :s + 1], norm.weight, norm.eps), together[r:r + 1, :s + 1]), (r, s)
    if device == "cuda":  # the module takes the kernel on CUDA
        assert torch.equal(norm(x), together)
    # The residual add fused in front: the sum as torch's add rounds it, its norm as the kernel above
    residual = (3 * torch.randn(6, 9, 1536)).to(device, dtype)
    total, normed = add_rms_norm(residual, x, norm.weight, norm.eps)
    assert torch.equal(total, residual + x) and torch.equal(normed, rms_norm(residual + x, norm.weight, norm.eps))
    alone_total, alone_normed = add_rms_norm(residual[2:3, 4:5], x[2:3, 4:5], norm.weight, norm.eps)
    assert torch.equal(alone_total, total[2:3, 4:5]) and torch.equal(alone_normed, normed[2:3, 4:5])
    if device == "cuda":  # a decoder layer takes it on CUDA
        from draftwise.model.layers import add_and_norm
        assert all(torch.equal(a, b) for a, b in zip(add_and_norm(residual, x, norm), (total, normed)))
    print("ok", worst)
""")



def test_the_triton_rmsnorm_in_the_interpreter():
    run_check(CHECK, interpreted=True, device="cpu", dtype="float32")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_triton_rmsnorm_on_cuda(dtype):
    run_check(CHECK, interpreted=False, device="cuda", dtype=dtype)
