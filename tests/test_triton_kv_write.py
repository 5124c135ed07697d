"""The Triton cache write (the GPU's): the same storage as `index_copy_`, keys and values, from the
token-major layouts a pass produces (values a strided view of the QKV output), in Triton's
interpreter on the CPU and on CUDA where there is one, where the cache write takes it."""

import textwrap

import pytest
import torch

from tests.triton_checks import run_check

pytest.importorskip("triton")

CHECK = textwrap.dedent("""
    import torch
    from draftwise.cache.triton_kv_write import fits, write
    device, dtype = "{device}", getattr(torch, "{dtype}")
    torch.manual_seed(0)
    slots_held, kv_heads, dim, tokens = 64, 2, 24, 7  # [Hkv, D] = 48 values: not a power of two
    keys = torch.randn(slots_held, kv_heads, dim, device=device).to(dtype)
    values = torch.randn(slots_held, kv_heads, dim, device=device).to(dtype)
    qkv = torch.randn(tokens, (6 + 2 * kv_heads) * dim, device=device).to(dtype)
    new_keys = torch.randn(tokens, kv_heads, dim, device=device).to(dtype)
    new_values = qkv[:, -kv_heads * dim:].view(tokens, kv_heads, dim)  # strided: a token's row apart
    slots = torch.tensor([5, 17, 3, 40, 41, 63, 0], device=device)
    assert fits(keys, new_keys, new_values)
    expected_keys, expected_values = keys.clone(), values.clone()
    expected_keys.index_copy_(0, slots, new_keys)
    expected_values.index_copy_(0, slots, new_values)
    write(keys, values, slots, new_keys, new_values)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    if device == "cuda":  # the cache write takes it on CUDA
        from draftwise.cache.kv_cache import write_kv
        again_keys, again_values = torch.zeros_like(keys), torch.zeros_like(values)
        write_kv(again_keys, again_values, slots, new_keys.view(1, tokens, kv_heads, dim).transpose(1, 2),
                 new_values.view(1, tokens, kv_heads, dim).transpose(1, 2))
        assert torch.equal(again_keys[slots], new_keys) and torch.equal(again_values[slots], new_values)
    print("ok")
""")



def test_the_triton_cache_write_in_the_interpreter():
    run_check(CHECK, interpreted=True, device="cpu", dtype="float32")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_triton_cache_write_on_cuda(dtype):
    run_check(CHECK, interpreted=False, device="cuda", dtype=dtype)
