"""The decoder layer's native small ops (RMSNorm, rotary, SiLU-gated product) against the op-by-op
path, and their rows independent of the pass."""

import pytest
import torch
import torch.nn.functional as F

from draftwise.model import layers, native_layer_ops
from draftwise.model.layers import RMSNorm, SwiGLU, rotary_cos_sin

pytestmark = pytest.mark.skipif(native_layer_ops.layer_ops() is None, reason="native layer ops unavailable here")


@pytest.fixture
def op_by_op(monkeypatch):
    """Runs the block with the op-by-op path (what a machine without the native ops computes)."""
    def run(function, *args):
        with monkeypatch.context() as patch:
            patch.setattr(native_layer_ops, "usable", lambda x: False)
            return function(*args)
    return run


def test_rms_norm_matches_op_by_op_and_rows_are_independent(op_by_op):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data = torch.randn(96)
    x = torch.randn(2, 9, 96) * torch.linspace(0.1, 20, 96)
    with torch.no_grad():
        native, reference = norm(x), op_by_op(norm, x)
        assert torch.allclose(native, reference, rtol=1e-5, atol=1e-6)
        rows = x.view(18, 96)
        assert all(torch.equal(norm(rows[i:i + 1])[0], native.view(18, 96)[i]) for i in range(18))


def test_rotary_matches_op_by_op_on_strided_heads(op_by_op):
    torch.manual_seed(1)
    qkv = torch.randn(2, 5, 3 * 4 * 16)  # [B, S, 3 heads' worth x 4 heads x D=16]
    q = qkv[..., :64].view(2, 5, 4, 16).transpose(1, 2)  # [B, H, S, D], not contiguous
    positions = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]])
    cos, sin = rotary_cos_sin(positions, 16, 10000.0, torch.float32)
    native = layers.apply_rotary(q, cos, sin)
    reference = op_by_op(layers.apply_rotary, q, cos, sin)
    assert native.shape == reference.shape and torch.allclose(native, reference, rtol=1e-6, atol=1e-6)
    alone = layers.apply_rotary(q[1:, :, 2:3], cos[1:, :, 2:3].contiguous(), sin[1:, :, 2:3].contiguous())
    assert torch.equal(alone[0, :, 0], native[1, :, 2])


def test_silu_gated_product_matches_op_by_op(op_by_op):
    torch.manual_seed(2)
    mlp = SwiGLU(32, 48)
    x = torch.randn(3, 4, 32)
    with torch.no_grad():
        native, reference = mlp(x), op_by_op(mlp, x)
        gate, up = mlp.gate_up_proj(x).split(48, dim=-1)
        assert torch.allclose(native, mlp.down_proj(F.silu(gate) * up))
        assert torch.allclose(native, reference)
    gate_up = torch.randn(7, 2 * 4096)  # rows long enough for ATen to split a whole-tensor SiLU across threads
    together = native_layer_ops.layer_ops().silu_mul(gate_up)
    assert all(torch.equal(native_layer_ops.layer_ops().silu_mul(gate_up[i:i + 1])[0], together[i]) for i in range(7))
