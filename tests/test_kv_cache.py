"""KV-cache rollback is bookkeeping, paged blocks hold each row, and ragged batches give each row its solo logits."""

import os

import pytest
import torch

from draftwise.loading.hf_folder import load_model
from draftwise.runner.model_runner import ModelRunner

TOKENS = [5, 17, 42, 99, 3, 250, 7, 8, 120, 33, 61, 2, 77]


@pytest.fixture(scope="module")
def model(tiny_qwen):
    return load_model(tiny_qwen)


def recompute(model, tokens):
    """Logits of the last token, computed from scratch without a cache."""
    with torch.no_grad():
        return model(torch.tensor([tokens]), torch.arange(len(tokens))[None])[0, -1]


def test_write_truncate_rewrite_equals_recomputation(model):
    runner = ModelRunner(model, max_num_rows=2, max_len=64, block_size=4)
    row = runner.allocate()
    runner.forward([row], [TOKENS[:8]], [1])
    runner.forward([row], [[200, 201, 202]], [3])  # a rejected continuation...
    runner.truncate(row, 8)  # ...rolled back without copying
    assert runner.length(row) == 8
    result = runner.forward([row], [TOKENS[8:11]], [1])  # overwrite the stale entries
    torch.testing.assert_close(result.logits[0], recompute(model, TOKENS[:11]), rtol=1e-4, atol=1e-4)


def test_logits_of_several_positions(model):
    runner = ModelRunner(model, max_num_rows=1, max_len=64)
    row = runner.allocate()
    runner.forward([row], [TOKENS[:5]], [1])
    result = runner.forward([row], [TOKENS[5:9]], [4])
    assert result.cu_num_logits == [0, 4]
    for i in range(4):
        torch.testing.assert_close(result.logits[i], recompute(model, TOKENS[:6 + i]), rtol=1e-4, atol=1e-4)


def test_ragged_batch_equals_each_row_alone(model):
    runner = ModelRunner(model, max_num_rows=4, max_len=64, block_size=4)
    prompts = [TOKENS[:3], TOKENS, TOKENS[:7], [9]]
    rows = [runner.allocate() for _ in prompts]
    rows = [rows[2], rows[0], rows[3], rows[1]]  # not in allocation order: exercises the gather path
    result = runner.forward(rows, prompts, [1, 2, 1, 1])
    appended = [[11], [12, 13], [], [14, 15, 16]]
    active = [i for i, a in enumerate(appended) if a]
    second = runner.forward([rows[i] for i in active], [appended[i] for i in active], [1] * len(active))
    for b, prompt in enumerate(prompts):
        torch.testing.assert_close(result.logits[result.cu_num_logits[b + 1] - 1], recompute(model, prompt),
                                   rtol=1e-4, atol=1e-4)
    for j, b in enumerate(active):
        torch.testing.assert_close(second.logits[j], recompute(model, prompts[b] + appended[b]),
                                   rtol=1e-4, atol=1e-4)
    assert [runner.length(r) for r in rows] == [4, 15, 7, 4]


def test_interleaved_sequences_read_their_own_scattered_blocks(model):
    """Two sequences growing in turn get interleaved blocks; each still reads exactly its own keys,
    through the gather path (and alone, with consecutive blocks, through a slice)."""
    runner = ModelRunner(model, max_num_rows=2, max_len=64, block_size=2)
    a, b = runner.allocate(), runner.allocate()
    for start in range(0, 12, 3):
        runner.forward([a], [TOKENS[start:start + 3]], [1])
        result = runner.forward([b], [TOKENS[::-1][start:start + 3]], [1])
    assert runner.blocks.contiguous_start(a, 12) is None  # blocks interleave
    torch.testing.assert_close(result.logits[0], recompute(model, TOKENS[::-1][:12]), rtol=1e-4, atol=1e-4)
    both = runner.forward([a, b], [[5], [6]], [1, 1])
    torch.testing.assert_close(both.logits[0], recompute(model, TOKENS[:12] + [5]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(both.logits[1], recompute(model, TOKENS[::-1][:12] + [6]), rtol=1e-4, atol=1e-4)
    runner.blocks.check_invariants()


def test_blocks_return_to_the_pool_and_bounds_are_checked(model):
    runner = ModelRunner(model, max_num_rows=1, max_len=8, block_size=4)
    assert runner.blocks.num_free_blocks == 2
    row = runner.allocate()
    runner.forward([row], [TOKENS[:8]], [1])
    assert runner.blocks.num_free_blocks == 0
    with pytest.raises(Exception, match="context holds 8"):
        runner.forward([row], [[1]], [1])
    with pytest.raises(ValueError):
        runner.truncate(row, 9)
    runner.truncate(row, 3)  # a rejected run rolled back: its block goes back
    assert runner.blocks.num_free_blocks == 1 and runner.length(row) == 3
    runner.free(row)
    assert runner.blocks.num_free_blocks == 2
    runner.blocks.check_invariants()


def test_a_full_cache_is_a_clear_error(model):
    from draftwise.errors import KVCacheFullError

    runner = ModelRunner(model, max_num_rows=1, max_len=64, num_blocks=2, block_size=4)
    row = runner.allocate()
    with pytest.raises(KVCacheFullError, match="needs 3 more blocks of 4 tokens but 2 of 2 are free"):
        runner.forward([row], [TOKENS[:9]], [1])


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the resident size from /proc")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pool_is_zero_and_becomes_resident_only_where_written(dtype):
    """A pool sized for max_num_seqs x max_model_len is not resident from the start (torch.zeros made
    it so): pages are taken as tokens are written."""
    from draftwise.cache.kv_cache import KVCache

    before = _resident_bytes()
    cache = KVCache(num_layers=4, num_blocks=4096, block_size=16, num_kv_heads=2, head_dim=128, dtype=dtype)
    size = cache.keys.numel() * cache.keys.element_size() * 2  # 512 MiB of keys and values in fp32
    assert cache.keys.dtype == dtype and cache.keys.shape == (4, 4097 * 16, 2, 128)
    assert _resident_bytes() - before < size / 8
    assert not cache.keys[:, :64].any() and not cache.values[:, -64:].any()  # zero where nothing was written
    cache.keys[0, :16] = 1.0
    assert cache.keys[0, :16].eq(1).all() and not cache.keys[1, :16].any()
