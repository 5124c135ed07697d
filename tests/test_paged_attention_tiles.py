"""The CPU's paged attention kernel (`cache/kernels/paged_attention.h`) takes consecutive queries of a
row a tile at a time, reading each block of keys and values once for the tile: every query's result
is still bit for bit what it computes alone, in any tile, beside any rows, and it is attention."""

import pytest
import torch

from draftwise.cache import attention_backend

kernels = attention_backend.native_kernels()
needs_kernel = pytest.mark.skipif(kernels is None, reason="no native attention kernel on this machine")
BLOCK, HEADS, KV_HEADS, D = 16, 12, 2, 64
EMPTY = torch.empty(0, dtype=torch.long)


def attend(q, keys, values, table, rows, positions, window=0):
    return kernels.paged_attention(q, keys, values, table, BLOCK, rows, positions, EMPTY, EMPTY.view(0, 0),
                                   D ** -0.5, window)


def cache(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(64 * BLOCK, KV_HEADS, D, generator=generator)
    values = torch.randn(64 * BLOCK, KV_HEADS, D, generator=generator)
    table = torch.randperm(64, generator=generator).view(4, 16).long()  # 4 rows of 16 blocks, shuffled
    return keys, values, table


@needs_kernel
@pytest.mark.parametrize("window", [0, 40])
def test_a_query_computes_alone_what_it_computes_in_any_tile(window):
    keys, values, table = cache()
    # row 0: a prompt of 11 (tiles of 4, 4, 3); row 1: one token; row 2: a verification of 6; row 3: 2
    rows = torch.tensor([0] * 11 + [1] + [2] * 6 + [3] * 2)
    positions = torch.tensor(list(range(11)) + [200] + list(range(90, 96)) + [254, 255])
    q = torch.randn(len(rows), HEADS, D, generator=torch.Generator().manual_seed(1))
    together = attend(q, keys, values, table, rows, positions, window)
    for n in range(len(rows)):
        alone = attend(q[n:n + 1].contiguous(), keys, values, table, rows[n:n + 1], positions[n:n + 1], window)
        assert torch.equal(alone, together[n:n + 1]), n
    shifted = attend(q[1:].contiguous(), keys, values, table, rows[1:], positions[1:], window)  # other tiles
    assert torch.equal(shifted, together[1:])


@needs_kernel
def test_tiled_queries_compute_attention():
    keys, values, table = cache(2)
    rows, positions = torch.zeros(7, dtype=torch.long), torch.arange(50, 57)
    q = torch.randn(7, HEADS, D, generator=torch.Generator().manual_seed(3))
    got = attend(q, keys, values, table, rows, positions).double()
    slots = (table[0].repeat_interleave(BLOCK) * BLOCK + torch.arange(BLOCK).repeat(16))[:57]
    k, v = keys[slots].double(), values[slots].double()  # [57, Hkv, D]
    for n in range(7):
        for h in range(HEADS):
            g = h // (HEADS // KV_HEADS)
            scores = (k[:positions[n] + 1, g] @ q[n, h].double()) * D ** -0.5
            expected = torch.softmax(scores, 0) @ v[:positions[n] + 1, g]
            assert (got[n, h] - expected).abs().max() < 1e-5, (n, h)


@needs_kernel
def test_index_tensors_are_checked_not_read_blindly():
    """A strided view of positions, a query row past the block tables, a block entry past the cache
    or keys of another head size: each refused by name (a strided view was read wrongly and a row
    past the tables crashed the process)."""
    block, heads, kv_heads, d = 16, 4, 2, 32
    draw = torch.Generator().manual_seed(0)
    keys, values = torch.randn(8 * block, kv_heads, d, generator=draw), torch.randn(8 * block, kv_heads, d, generator=draw)
    table, q = torch.arange(8).view(2, 4).long(), torch.randn(2, heads, d, generator=draw)
    rows, none = torch.tensor([0, 1]), torch.empty(0, dtype=torch.long)

    def attend(table=table, rows=rows, positions=torch.tensor([5, 40]), keys=keys, values=values):
        return kernels.paged_attention(q, keys, values, table, block, rows, positions, none, none.view(0, 0),
                                       d ** -0.5, 0)

    assert torch.isfinite(attend()).all()
    for bad, message in ((dict(positions=torch.tensor([[5, 7], [40, 9]])[:, 0]), "contiguous int64"),
                         (dict(positions=torch.tensor([5, 40], dtype=torch.int32)), "contiguous int64"),
                         (dict(rows=torch.tensor([0, 7])), "query row past"),
                         (dict(rows=torch.tensor([0])), "one entry per query"),
                         (dict(table=torch.tensor([[0, 1, 2, 99], [4, 5, 6, 7]])), "block table entry past"),
                         (dict(keys=keys[..., :16].contiguous(), values=values[..., :16].contiguous()), "keys and values")):
        with pytest.raises(RuntimeError, match=message):
            attend(**bad)
