"""GGUF's Q4_K and Q6_K in their own super-blocks (`quant/superblock_strips.py`, q8_matmul.cpp): the
integers read from the file reproduce gguf-py's dequantization exactly, the strips round-trip, the
kernels compute exactly the int8-activation product they describe, a row's output does not depend on
the rows beside it, and a converted Q4_K_M-like GGUF computes with the file's own weights, a
verification pass equal to single steps bit for bit."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from draftwise.quant.native import kernels as native_kernels
from draftwise.quant.q4k import q4k_factors, q4k_to_groups
from draftwise.quant.q6k import BLOCK_BYTES as Q6K_BLOCK_BYTES, q6k_values
from draftwise.quant.superblock_strips import (kernel_available, pack_q4k_strips, pack_q6k_strips,
                                               unpack_q4k_strips, unpack_q6k_strips)
from tests.test_quantization import random_q4k_bytes

needs_kernels = pytest.mark.skipif(not kernel_available("q6k_matmul_q8", 256),
                                   reason="no AVX-512 VNNI super-block kernels on this machine")


def random_q6k_bytes(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid Q6_K data: random 6-bit quants and int8 scales (negative ones too), fp16 d."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, Q6K_BLOCK_BYTES), dtype=np.uint8)
    blocks[:, 208:210] = np.frombuffer(rng.uniform(1e-4, 1e-3, len(blocks)).astype(np.float16).tobytes(),
                                       np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def q6k_weight(q, sub_scales, d) -> torch.Tensor:
    return d.float().repeat_interleave(256, 1) * sub_scales.float().repeat_interleave(16, 1) * (q.float() - 32)


def q4k_weight(quants, sub_scales, sub_mins, d, dmin) -> torch.Tensor:
    return (d.float().repeat_interleave(256, 1) * sub_scales.float().repeat_interleave(32, 1) * quants.float()
            - dmin.float().repeat_interleave(256, 1) * sub_mins.float().repeat_interleave(32, 1))


def random_q6k(n: int, k: int, seed: int = 0):
    values = q6k_values(random_q6k_bytes(n, k, seed), n, k)
    return torch.from_numpy(values["q"]), torch.from_numpy(values["sub_scales"]), torch.from_numpy(values["d"])


def random_q4k(n: int, k: int, seed: int = 0):
    raw = random_q4k_bytes(n, k, seed)
    factors = {key: torch.from_numpy(value) for key, value in q4k_factors(raw, n, k).items()}
    quants = torch.from_numpy(q4k_to_groups(raw, n, k)[0])
    return quants, factors["sub_scales"], factors["sub_mins"], factors["d"], factors["dmin"]


def test_q6k_values_reproduce_gguf_dequantization_exactly():
    raw = random_q6k_bytes(8, 512)
    values = q6k_values(raw, 8, 512)
    assert values["q"].max() <= 63 and values["sub_scales"].min() < 0  # (the sign matters)
    rebuilt = q6k_weight(*(torch.from_numpy(values[key]) for key in ("q", "sub_scales", "d")))
    assert torch.equal(rebuilt, torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q6_K).reshape(8, 512)))


def test_q4k_factors_rebuild_the_groups_scales_and_minimums_exactly():
    raw = random_q4k_bytes(8, 512)
    _, scales, minimums = q4k_to_groups(raw, 8, 512)
    factors = q4k_factors(raw, 8, 512)
    d, dmin = (np.repeat(factors[key].astype(np.float32), 8, axis=1) for key in ("d", "dmin"))
    assert np.array_equal(d * factors["sub_scales"], scales) and np.array_equal(dmin * factors["sub_mins"], minimums)


@pytest.mark.parametrize("n", [16, 40])
def test_strips_round_trip(n):
    q6k = random_q6k(n, 512)
    assert all(torch.equal(a, b) for a, b in zip(unpack_q6k_strips(pack_q6k_strips(*q6k), n, 512), q6k))
    q4k = random_q4k(n, 512)
    assert all(torch.equal(a, b) for a, b in zip(unpack_q4k_strips(pack_q4k_strips(*q4k), n, 512), q4k))


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernels multiply: each group of 32 inputs as a * p, a = max|x| / 127, p = round(x / a)."""
    groups = x.view(x.shape[0], -1, 32)
    max_abs = groups.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(max_abs > 0, 127.0 / max_abs, torch.zeros_like(max_abs))
    p = torch.round(groups * inverse)  # (float32, as the kernel: x * (127 / max), round to nearest even)
    return ((max_abs / 127.0).double() * p.double()).view_as(x)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_kernels_compute_the_int8_activation_product(rows):
    """Against the same product in float64: only the float32 summation may differ (a wrong half, sign,
    scale or offset would be off by far more)."""
    generator = torch.Generator().manual_seed(rows)
    n, k = 40, 768
    x = torch.randn(rows, k, generator=generator)
    for weights, pack, kernel in ((random_q6k(n, k), pack_q6k_strips, "q6k_matmul_q8"),
                                  (random_q4k(n, k), pack_q4k_strips, "q4k_matmul_q8")):
        weight = (q6k_weight if kernel.startswith("q6k") else q4k_weight)(*weights).double()  # [N, K]
        expected = quantized_activations(x) @ weight.t()
        got = getattr(native_kernels(), kernel)(x, pack(*weights), n).double()
        assert got.shape == (rows, n)
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), kernel


@needs_kernels
def test_a_rows_output_does_not_depend_on_the_rows_beside_it():
    generator = torch.Generator().manual_seed(0)
    n, k = 200, 512
    x = torch.randn(64, k, generator=generator)
    for strips, kernel in ((pack_q6k_strips(*random_q6k(n, k)), "q6k_matmul_q8"),
                           (pack_q4k_strips(*random_q4k(n, k)), "q4k_matmul_q8")):
        matmul = getattr(native_kernels(), kernel)
        batch = matmul(x, strips, n)
        for rows in (slice(0, 1), slice(0, 3), slice(5, 9), slice(3, 11), slice(0, 64)):  # (tiles of 1, 3, 4, 8 rows)
            assert torch.equal(matmul(x[rows].contiguous(), strips, n), batch[rows]), (kernel, rows)


@pytest.fixture()
def q4k_m_like_model(tmp_path, monkeypatch):
    """A converted GGUF laid out like Q4_K_M: Q4_K weights, down_proj and v_proj in Q6_K."""
    from draftwise.loading.resolve import resolve_model
    from tests.tiny_models import write_tiny_gguf, write_tiny_model

    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    hf_folder = write_tiny_model(tmp_path / "wide", "qwen2", seed=3, hidden_size=256)
    path = write_tiny_gguf(hf_folder, tmp_path / "q4k_m.gguf", quantize_q4k=True, q6k_for=("down_proj", "v_proj"))
    return resolve_model(str(path), progress=False)


@needs_kernels
def test_a_q4k_m_file_computes_with_its_own_weights(q4k_m_like_model):
    from draftwise.loading.hf_folder import load_model
    from draftwise.quant.q6k_linear import Q6KLinear

    model = load_model(q4k_m_like_model, quantization="int4")
    report = model.quantization
    assert "layers.0.mlp.down_proj" in report.q6k_from_file  # all Q6_K: the file's blocks
    assert "layers.0.self_attn.qkv_proj" in report.int8  # q, k Q4_K beside a Q6_K v: int8, as before
    assert "layers.0.mlp.gate_up_proj" in report.int4_from_file
    down, gate_up = model.layers[0].mlp.down_proj, model.layers[0].mlp.gate_up_proj
    assert isinstance(down, Q6KLinear) and "q4k_strips" in gate_up.packed_state()
    reference = load_model(q4k_m_like_model, quantization="none", pack_cpu_weights=False)  # gguf-py's dequantization
    assert torch.equal(down.dequantized(), reference.layers[0].mlp.down_proj.weight)
    expected = reference.layers[0].mlp.gate_up_proj.weight
    assert (gate_up.dequantized() - expected).abs().max() <= 1e-6 * expected.abs().max()


def test_a_layers_rows_dequantized_alone_are_those_rows_of_the_whole(q4k_m_like_model):
    """A trimmed LM head takes its kept rows in float from the quantized head or table without
    dequantizing the rest (~3 GB for a moment for the 0.5B's): the same values, every format."""
    from draftwise.loading.hf_folder import load_model

    kinds = set()
    for mode in ("int4", "int4_all"):
        model = load_model(q4k_m_like_model, quantization=mode)
        for name, layer in model.named_modules():
            whole = layer.rows if hasattr(layer, "rows") else getattr(layer, "dequantized", None)
            if whole is None or not callable(whole):
                continue
            full = layer.dequantized()
            rows = torch.tensor([full.shape[0] - 1, 0, 3, 0])  # (unsorted, strips shared, one twice)
            assert torch.equal(whole(rows), full[rows]), name
            layout = next(iter(layer.packed_state())) if hasattr(layer, "packed_state") else None
            kinds.add(type(layer).__name__ + (f"/{layout}" if layout else ""))
    if kernel_available("q6k_matmul_q8", 256):  # (the super-block kernels: AVX-512 VNNI)
        expected = {"Q6KLinear", "Int8Linear", "Int4Linear/q4k_strips", "Int4Linear/strips"}
    else:  # (an AVX2 CPU: the file's Q6_K layers as int8, its Q4_K ones as int4 strips)
        expected = {"Int8Linear", "Int4Linear/strips"}
    assert expected <= {kind if "Int4" in kind else kind.split("/")[0] for kind in kinds}, kinds
    assert any(kind.startswith("Int4Embedding") for kind in kinds), kinds


@needs_kernels
def test_q4k_m_verification_pass_equals_single_steps_bit_for_bit(q4k_m_like_model):
    from draftwise.loading.hf_folder import load_model
    from draftwise.runner.model_runner import ModelRunner
    from tests.test_quantization import verify_pass_and_single_steps

    model = load_model(q4k_m_like_model, quantization="int4")
    assert model.quantization.q6k_from_file
    runner = ModelRunner(model, max_num_rows=3, max_len=128)
    together, steps, _ = verify_pass_and_single_steps(runner, [5, 17, 42, 99, 3, 250, 7], [8, 120, 33, 61, 2, 77])
    assert torch.equal(together, steps)


def logits(model):
    """The logits of one 5-token pass."""
    from draftwise.runner.model_runner import ModelRunner

    runner = ModelRunner(model, max_num_rows=1, max_len=64)
    return runner.forward([runner.allocate()], [[5, 17, 42, 99, 3]], [5]).logits


@needs_kernels
def test_the_packed_cache_keeps_the_super_block_layers(q4k_m_like_model, monkeypatch):
    import draftwise.loading.hf_folder as hf_folder

    first = hf_folder.load_model(q4k_m_like_model, quantization="int4")
    monkeypatch.setattr(hf_folder, "quantize_model", lambda *args: pytest.fail("quantized despite the cache"))
    cached = hf_folder.load_model(q4k_m_like_model, quantization="int4")
    assert cached.quantization == first.quantization
    assert torch.equal(logits(cached), logits(first))


@needs_kernels
def test_first_quantization_leaves_the_files_own_layers_float_copies_unread(q4k_m_like_model, monkeypatch):
    import draftwise.loading.hf_folder as hf_folder

    reads = []
    read_tensors = hf_folder._read_tensors
    monkeypatch.setattr(hf_folder, "_read_tensors", lambda folder, **kw: reads.append(kw) or read_tensors(folder, **kw))
    monkeypatch.setattr(hf_folder, "save_packed", lambda *args: None)  # (every load below quantizes)
    lean = hf_folder.load_model(q4k_m_like_model, quantization="int4")
    unread = reads[0]["unread"]
    assert {"layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.self_attn.o_proj.weight", "embed_tokens.weight"} <= unread
    assert not unread & {"layers.0.self_attn.q_proj.weight", "layers.0.self_attn.v_proj.weight"}  # (int8: read)
    monkeypatch.setattr(hf_folder, "float_free_weights", lambda *args: set())  # every float weight read, as before
    full = hf_folder.load_model(q4k_m_like_model, quantization="int4")
    assert lean.quantization == full.quantization and torch.equal(logits(lean), logits(full))


@needs_kernels
def test_native_layers_compute_the_python_layers_bits_with_super_block_weights(q4k_m_like_model):
    from draftwise import LLM
    from draftwise.model import native_decoder
    from tests.test_native_layers import native_and_python

    if native_decoder.decoder_module() is None:
        pytest.skip("no native decoder layers on this machine")
    llm = LLM(str(q4k_m_like_model), max_model_len=128, max_num_seqs=2, progress=False, quantization="int4",
              adaptive_threads=False)
    model = llm.runner.model
    assert model.quantization.q6k_from_file
    assert all(model.native_layer(i) is not None for i in range(len(model.layers)))
    kinds = {native_decoder.describe_linear(linear).kind for layer in model.layers
             for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)}
    assert {"q4k_q8", "q6k_q8"} <= kinds
    native, python = native_and_python(llm)
    for index, (a, b) in enumerate(zip(native, python)):
        assert torch.equal(a, b), f"output {index}: max |diff| {(a - b).abs().max().item():.3g}"
