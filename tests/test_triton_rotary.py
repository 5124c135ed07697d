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
    # Into the cache: the rotated keys and the values at each token's slot, the same bits, nothing else written
    slots = torch.randperm(40, device=device)[:batch * seq]
    keys = torch.full((40, kv_heads, dim), 7.0, device=device).to(dtype)
    values = torch.full((40, kv_heads, dim), 7.0, device=device).to(dtype)
    stored_q, none = rotate_queries_and_keys(qkv, cos, sin, heads, kv_heads, dim, (keys, values, slots))
    expected_v = heads_of(heads + kv_heads, kv_heads).transpose(1, 2).reshape(batch * seq, kv_heads, dim)
    assert none is None and torch.equal(stored_q, q)
    assert torch.equal(keys[slots], k) and torch.equal(values[slots], expected_v)
    untouched = torch.ones(40, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert bool((keys[untouched] == 7).all()) and bool((values[untouched] == 7).all())
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


STEP_CHECK = textwrap.dedent("""
    import torch
    from draftwise.loading.hf_folder import load_model
    from draftwise.model import native_layer_ops, triton_rotary
    from draftwise.model.attention import Attention
    from draftwise.runner.model_runner import ModelRunner
    native_layer_ops.usable = lambda x: False  # torch's ops on the CPU: the formula the kernel rounds like
    from pathlib import Path
    model = load_model(Path("{model}"), quantization="none")
    model.native_layers = False  # every layer in Python, through Attention.forward
    runner = ModelRunner(model, 2, 96, step_mode="eager")  # the static step's view offers its storage

    def logits():
        rows = [runner.allocate(), runner.allocate()]
        try:  # prompts, a step, a ragged verification pass
            out = [runner.forward(rows, [[5, 9, 14, 2], [33, 7]], [1, 1]).logits.clone(),
                   runner.forward(rows, [[11], [4]], [1, 1]).logits.clone(),
                   runner.forward(rows, [[3, 8, 21], [6]], [3, 1]).logits.clone()]
            return out + [runner.cache.keys.clone(), runner.cache.values.clone()]
        finally:
            for row in rows:
                runner.free(row)

    op_by_op = logits()
    stores = []
    kernel = triton_rotary.rotate_queries_and_keys
    triton_rotary.rotate_queries_and_keys = lambda *a: stores.append(a[-1] is not None) or kernel(*a)
    Attention._one_kernel_rotation = lambda self, qkv, cos: triton_rotary
    fused = logits()
    assert stores and all(stores), stores  # every layer stored its keys and values itself
    for a, b in zip(op_by_op, fused):
        assert torch.equal(a, b), float((a - b).abs().max())
    print("ok")
""")


def test_the_triton_rotary_in_the_interpreter():
    run_check(KERNEL_CHECK, interpreted=True, device="cpu", dtype="float32")


def test_a_model_taking_the_kernel_computes_the_same_logits_in_the_interpreter(tiny_qwen):
    run_check(MODEL_CHECK, interpreted=True, model=tiny_qwen)


def test_a_static_step_whose_keys_the_kernel_stores_computes_the_same_logits_and_cache(tiny_qwen):
    """The kernel's cache stores (`write_target`): the same logits, and the same bits in the cache."""
    run_check(STEP_CHECK, interpreted=True, model=tiny_qwen)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_triton_rotary_on_cuda(dtype):
    run_check(KERNEL_CHECK, interpreted=False, device="cuda", dtype=dtype)
