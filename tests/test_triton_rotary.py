"""The Triton rotary kernel (the GPU's): against `apply_rotary`'s ops bit for bit and for row
independence, in Triton's interpreter on the CPU (fp32: the interpreter has no bf16) and on CUDA where
there is one (bf16 and fp32); and a model whose attention takes it computes the logits it computed
op by op."""

import textwrap

import pytest
import torch

from tests.triton_checks import run_check

pytest.importorskip("triton")

KERNEL_CHECK = textwrap.dedent("""
    import torch
    from draftwise.model.layers import rotary_cos_sin
    from draftwise.model.triton_rotary import rotate_queries_and_keys
    device, dtype = "{device}", getattr(torch, "{dtype}")
    torch.manual_seed(0)
    batch, seq, heads, kv_heads, dim = 3, 5, 12, 2, 128
    qkv = torch.randn(batch, seq, (heads + 2 * kv_heads) * dim, device=device).to(dtype)
    positions = torch.arange(seq, device=device)[None] + torch.tensor([[0], [40], [900]], device=device)  # [B, S]
    cos, sin = rotary_cos_sin(positions, dim, 1e6, dtype)  # [B, 1, S, D]
    q, k = rotate_queries_and_keys(qkv, cos, sin, heads, kv_heads, dim)

    def op_by_op(x):  # x [B, H, S, D]: apply_rotary's torch formula
        half = dim // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def heads_of(start, count):  # [B, H, S, D] from the QKV output
        return qkv[..., start * dim:(start + count) * dim].view(batch, seq, count, dim).transpose(1, 2)

    expected_q = op_by_op(heads_of(0, heads)).transpose(1, 2).reshape(batch * seq, heads, dim)
    expected_k = op_by_op(heads_of(heads, kv_heads)).transpose(1, 2).reshape(batch * seq, kv_heads, dim)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k), float((q - expected_q).abs().max())
    for b, s in ((0, 0), (1, 2), (2, 4)):  # one token alone
        alone_q, alone_k = rotate_queries_and_keys(qkv[b:b + 1, s:s + 1], cos[b:b + 1, :, s:s + 1],
                                                   sin[b:b + 1, :, s:s + 1], heads, kv_heads, dim)
        assert torch.equal(alone_q[0], q[b * seq + s]) and torch.equal(alone_k[0], k[b * seq + s]), (b, s)
    print("ok")
""")

MODEL_CHECK = textwrap.dedent("""
    import torch
    from draftwise import LLM
    from draftwise.model import native_layer_ops
    from draftwise.model.attention import Attention
    native_layer_ops.usable = lambda x: False  # torch's ops on the CPU: the formula the kernel rounds like
    llm = LLM("{model}", max_model_len=128, quantization="none", progress=False)
    llm.model.native_layers = False  # every layer in Python, through Attention.forward
    runner = llm.runner

    def logits():
        row = runner.allocate()
        try:  # a prompt, a step, a verification pass
            return [runner.forward([row], [[5, 9, 14, 2, 33, 7]], [6]).logits.clone(),
                    runner.forward([row], [[11]], [1]).logits.clone(),
                    runner.forward([row], [[3, 8, 21]], [3]).logits.clone()]
        finally:
            runner.free(row)

    op_by_op = logits()
    taken = []
    from draftwise.model import triton_rotary
    Attention._one_kernel_rotation = lambda self, qkv, cos: taken.append(1) or triton_rotary
    fused = logits()
    assert taken and all(torch.equal(a, b) for a, b in zip(op_by_op, fused))
    print("ok")
""")



def test_the_triton_rotary_in_the_interpreter():
    run_check(KERNEL_CHECK, interpreted=True, device="cpu", dtype="float32")


def test_a_model_taking_the_kernel_computes_the_same_logits_in_the_interpreter(tiny_qwen):
    run_check(MODEL_CHECK, interpreted=True, model=tiny_qwen)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_triton_rotary_on_cuda(dtype):
    run_check(KERNEL_CHECK, interpreted=False, device="cuda", dtype=dtype)
