"""The Triton paged-attention kernel (the GPU's): against SDPA and for batch invariance, in Triton's
interpreter on the CPU (a subprocess with TRITON_INTERPRET=1), and on CUDA where there is one."""

import textwrap

import pytest
import torch

from tests.triton_checks import run_check

pytest.importorskip("triton")

CHECK = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from draftwise.cache.triton_attention import triton_attention
    device = "{device}"
    torch.manual_seed(0)
    heads, kv_heads, dim, page = 12, 2, 64, 16
    keys = torch.randn(40 * page, kv_heads, dim, device=device)
    values = torch.randn(40 * page, kv_heads, dim, device=device)
    tables = torch.randperm(40, device=device)[:24].view(3, 8)  # three rows of 8 scattered blocks
    key_slots = (tables[:, :, None] * page + torch.arange(page, device=device)).flatten(1)  # [3, 128]
    positions = torch.tensor([[116, 117, 118, 119], [5, 6, 7, 8], [60, 61, 62, 63]], device=device)
    rows = torch.arange(3, device=device).repeat_interleave(4)
    q = torch.randn(3, heads, 4, dim, device=device)
    out = triton_attention(q, keys, values, tables, page, rows, positions.flatten())
    worst = 0.0
    for b in range(3):
        k = keys[key_slots[b]].transpose(0, 1)[None]
        v = values[key_slots[b]].transpose(0, 1)[None]
        for s in range(4):
            p = int(positions[b, s])
            ref = F.scaled_dot_product_attention(q[b:b + 1, :, s:s + 1], k[:, :, :p + 1], v[:, :, :p + 1],
                                                 enable_gqa=True)
            worst = max(worst, float((out[b:b + 1, :, s:s + 1] - ref).abs().max()))
            alone = triton_attention(q[b:b + 1, :, s:s + 1].contiguous(), keys, values, tables[b:b + 1], page,
                                     torch.zeros(1, dtype=torch.long, device=device), positions[b, s:s + 1])
            assert torch.equal(alone, out[b:b + 1, :, s:s + 1]), (b, s)
    assert worst < 1e-4, worst

    # A token tree in row 2: new tokens stored at 60..63 with parents (-1, 0, 0, 2) sit at positions
    # 60, 61, 61, 62; token 3 reads stored 60, 62, 63. It must compute what the chain of those
    # tokens computes, bit for bit: the same keys moved to positions 60, 61, 62.
    tree_positions = torch.tensor([60, 61, 61, 62], device=device)
    paths = torch.tensor([[60, 60, 60, 60], [60, 61, 60, 60], [60, 62, 60, 60], [60, 62, 63, 60]], device=device)
    tree = triton_attention(q[2:3], keys, values, tables[2:3], page, torch.zeros(4, dtype=torch.long, device=device),
                            tree_positions, torch.full((4,), 60, device=device), paths)
    moved_keys, moved_values = keys.clone(), values.clone()
    moved_keys[key_slots[2, 61:63]] = keys[key_slots[2, 62:64]]
    moved_values[key_slots[2, 61:63]] = values[key_slots[2, 62:64]]
    chain = triton_attention(q[2:3, :, 3:4].contiguous(), moved_keys, moved_values, tables[2:3], page,
                             torch.zeros(1, dtype=torch.long, device=device), tree_positions[3:4])
    assert torch.equal(tree[:, :, 3:4], chain)

    # A sliding window of 37 keys (Gemma 3's local layers) and a score scale of its own: against SDPA
    # over exactly the last 37 keys, and each query alone as in the pass.
    windowed = triton_attention(q, keys, values, tables, page, rows, positions.flatten(), scale=0.07, window=37)
    for b in range(3):
        k = keys[key_slots[b]].transpose(0, 1)[None]
        v = values[key_slots[b]].transpose(0, 1)[None]
        for s in range(4):
            p = int(positions[b, s])
            first = max(0, p + 1 - 37)
            ref = F.scaled_dot_product_attention(q[b:b + 1, :, s:s + 1], k[:, :, first:p + 1], v[:, :, first:p + 1],
                                                 enable_gqa=True, scale=0.07)
            assert float((windowed[b:b + 1, :, s:s + 1] - ref).abs().max()) < 1e-4, (b, s)
            alone = triton_attention(q[b:b + 1, :, s:s + 1].contiguous(), keys, values, tables[b:b + 1], page,
                                     torch.zeros(1, dtype=torch.long, device=device), positions[b, s:s + 1],
                                     scale=0.07, window=37)
            assert torch.equal(alone, windowed[b:b + 1, :, s:s + 1]), (b, s)

    # A long row (640 keys: 20 blocks, so each of the SPLITS programs merges two or three) beside a short one.
    long_table = torch.randperm(40, device=device).view(1, 40)
    both_tables = torch.cat([long_table, torch.cat([tables[0], tables[0], tables[0], tables[0], tables[0]])[None]])
    long_q = torch.randn(2, heads, 3, dim, device=device)
    long_positions = torch.tensor([597, 598, 599, 3, 100, 127], device=device)
    long_rows = torch.arange(2, device=device).repeat_interleave(3)
    both = triton_attention(long_q, keys, values, both_tables, page, long_rows, long_positions)
    long_slots = (long_table[0, :, None] * page + torch.arange(page, device=device)).flatten()
    k = keys[long_slots].transpose(0, 1)[None]
    v = values[long_slots].transpose(0, 1)[None]
    for s in range(3):
        p = int(long_positions[s])
        ref = F.scaled_dot_product_attention(long_q[:1, :, s:s + 1], k[:, :, :p + 1], v[:, :, :p + 1], enable_gqa=True)
        assert float((both[:1, :, s:s + 1] - ref).abs().max()) < 1e-4, s
        alone = triton_attention(long_q[:1, :, s:s + 1].contiguous(), keys, values, long_table, page,
                                 torch.zeros(1, dtype=torch.long, device=device), long_positions[s:s + 1])
        assert torch.equal(alone, both[:1, :, s:s + 1]), s
    print("ok", worst)
""")


def test_the_triton_kernel_in_the_interpreter():
    run_check(CHECK, interpreted=True, device="cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_triton_kernel_on_cuda():
    run_check(CHECK, interpreted=False, device="cuda")
