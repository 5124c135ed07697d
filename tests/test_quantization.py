"""Weight-only quantized layers: accuracy against their own dequantized weights, the Q4_K mapping,
and the batch invariance that makes speculative decoding bit-identical to plain decoding."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from draftwise.errors import InvalidParameterError
from draftwise.loading.hf_folder import load_model
from draftwise.runner.model_runner import ModelRunner
from draftwise.quant.linear import Int4Linear, Int8Linear, quantize_int4_groups
from draftwise.quant.native import has_bf16_kernels, kernels as native_kernels
from draftwise.quant.q4k import BLOCK_BYTES, q4k_to_groups


def test_native_kernels_build_wherever_the_machine_supports_them():
    """A broken build must fail here, not quietly fall back (the other native tests would skip)."""
    from draftwise.quant.native import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"native low-bit kernels not expected here: {reason}")
    assert native_kernels() is not None


@pytest.fixture(params=["native", "aten"])
def native(request) -> bool:
    """Both kernel paths of the quantized layers: the native one where this machine can build it."""
    if request.param == "native" and native_kernels() is None:
        pytest.skip("native low-bit kernels unavailable here")
    return request.param == "native"


def make_layer(kind: str, weight: torch.Tensor, bias: torch.Tensor | None, native: bool):
    if kind == "int4":
        return Int4Linear(*quantize_int4_groups(weight), bias, native=native)
    return Int8Linear(weight, bias, native=native)


def random_q4k_bytes(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid Q4_K data: fp16 d and dmin, random 6-bit scales/mins and 4-bit quants."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, BLOCK_BYTES), dtype=np.uint8)
    blocks[:, 0:2] = np.frombuffer(rng.uniform(0.001, 0.01, len(blocks)).astype(np.float16).tobytes(),
                                   np.uint8).reshape(-1, 2)
    blocks[:, 2:4] = np.frombuffer(rng.uniform(0.001, 0.02, len(blocks)).astype(np.float16).tobytes(),
                                   np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def test_q4k_groups_reproduce_gguf_dequantization_exactly():
    raw = random_q4k_bytes(8, 512)
    expected = dequantize(raw, GGMLQuantizationType.Q4_K).reshape(8, 512)
    quants, scales, minimums = q4k_to_groups(raw, 8, 512)
    assert quants.max() <= 15 and scales.shape == (8, 16)
    rebuilt = (scales[:, :, None] * quants.reshape(8, 16, 32) - minimums[:, :, None]).reshape(8, 512)
    np.testing.assert_allclose(rebuilt, expected, rtol=1e-6, atol=1e-7)


def test_int4_layer_holds_the_q4k_weights_up_to_bf16_scales(native):
    raw = random_q4k_bytes(64, 256, seed=1)
    expected = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K).reshape(64, 256))
    layer = Int4Linear(*(torch.from_numpy(a) for a in q4k_to_groups(raw, 64, 256)), None, native=native)
    assert (layer.kernels is not None) == native
    step = expected.abs().max()
    assert (layer.dequantized() - expected).abs().max() < 0.01 * step  # bf16 scale/zero rounding only


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantized_layer_equals_its_dequantized_reference(kind, native):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 128) * 0.05, torch.randn(96)
    layer = make_layer(kind, weight, bias, native)
    x = torch.randn(5, 3, 128)
    expected = x @ layer.dequantized().t() + bias
    got = layer(x)
    assert got.shape == (5, 3, 96)
    assert (got - expected).abs().max() < 0.02 * expected.abs().max()  # activations pass through bf16
    if kind == "int4":  # the quantization itself: within half a step of each group, up to bf16 scales
        quants, scales, minimums = quantize_int4_groups(weight)
        exact = (scales[..., None] * quants.view(96, -1, 32).float() - minimums[..., None]).view(96, 128)
        assert ((exact - weight).abs().view(96, -1, 32) <= scales[..., None] / 2 + 1e-7).all()
        assert (layer.dequantized() - exact).abs().max() < 0.01 * weight.abs().max()
    else:
        step = weight.abs().amax(dim=1, keepdim=True) / 127
        assert ((layer.dequantized() - weight).abs() <= step * 0.51).all()


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantized_layers_are_batch_invariant(kind, native):
    torch.manual_seed(1)
    weight = torch.randn(161 if native else 160, 64)  # odd: the native kernel works on channel pairs
    layer = make_layer(kind, weight, None, native)
    x = torch.randn(70, 64)  # beyond one 8-row tile and one 64-row block of the native kernel
    alone = [layer(x[i:i + 1]) for i in range(70)]
    for rows in (2, 5, 9, 17, 70):
        together = layer(x[:rows])
        assert all(torch.equal(together[i:i + 1], alone[i]) for i in range(rows))


def verify_pass_and_single_steps(runner: ModelRunner, prompt: list[int], extra: list[int]):
    """The logits of `extra` after `prompt` in one pass on one row and as single steps on another
    (both rows prefilled alike), and the two rows."""
    rows = [runner.allocate() for _ in range(2)]
    for row in rows:
        runner.forward([row], [prompt], [1])
    together = runner.forward([rows[0]], [extra], [len(extra)]).logits
    steps = torch.cat([runner.forward([rows[1]], [[t]], [1]).logits for t in extra])
    return together, steps, rows


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_verification_pass_equals_single_steps_bit_for_bit(tiny_qwen, quantization):
    """The property greedy losslessness rests on: k+1 tokens in one pass = k+1 decode steps."""
    runner = ModelRunner(load_model(tiny_qwen, quantization=quantization), max_num_rows=3, max_len=128)
    prompt, extra = [5, 17, 42, 99, 3, 250, 7], [8, 120, 33, 61, 2, 77]
    together, steps, rows = verify_pass_and_single_steps(runner, prompt, extra)
    assert torch.equal(together, steps)
    third = runner.allocate()
    runner.forward([third], [prompt], [1])
    ragged = runner.forward([third, rows[1]], [extra[:2], [9]], [2, 1]).logits
    assert torch.equal(ragged[:2], together[:2])


def test_quantization_report_and_bad_mode(tiny_qwen):
    model = load_model(tiny_qwen, quantization="int4")
    assert len(model.quantization.int4_quantized) == 2 * 4 + 1  # a float checkpoint: int4 everywhere
    with pytest.raises(InvalidParameterError, match="quantization must be one of"):
        load_model(tiny_qwen, quantization="int3")


def test_gguf_q4k_tensors_use_the_files_groups(tmp_path, monkeypatch):
    """A GGUF whose linear weights are Q4_K: the int4 model computes with exactly those weights."""
    import json

    from draftwise.loading.resolve import resolve_model
    from tests.tiny_models import write_tiny_gguf, write_tiny_model

    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    hf_folder = write_tiny_model(tmp_path / "wide", "qwen2", seed=3, hidden_size=256)
    path = write_tiny_gguf(hf_folder, tmp_path / "q4k.gguf", quantize_q4k=True)
    folder = resolve_model(str(path), progress=False)
    types = json.loads((folder / "draftwise.json").read_text())["gguf_types"]
    assert types["layers.0.mlp.gate_proj.weight"] == "Q4_K"
    model = load_model(folder, quantization="int4")
    assert "layers.0.mlp.gate_up_proj" in model.quantization.int4_from_file
    reference = load_model(folder, quantization="none", pack_cpu_weights=False)
    got = model.layers[0].mlp.gate_up_proj.dequantized()
    expected = reference.layers[0].mlp.gate_up_proj.weight
    assert (got - expected).abs().max() < 0.01 * expected.abs().max()


@pytest.fixture()
def mixed_q4k_model(tmp_path, monkeypatch):
    """A converted GGUF like Q4_K_M: most linear weights Q4_K, v_proj and down_proj Q8_0."""
    from draftwise.loading.resolve import resolve_model
    from tests.tiny_models import write_tiny_gguf, write_tiny_model

    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    hf_folder = write_tiny_model(tmp_path / "wide", "qwen2", seed=3, hidden_size=256)
    path = write_tiny_gguf(hf_folder, tmp_path / "mixed.gguf", quantize_q8=True, quantize_q4k=True,
                           q4k_except=("v_proj", "down_proj"))
    return resolve_model(str(path), progress=False)


def test_int4_keeps_wider_types_in_int8_and_int4_all_does_not(mixed_q4k_model):
    int4 = load_model(mixed_q4k_model, quantization="int4").quantization
    assert "layers.0.self_attn.qkv_proj" in int4.int8 and "layers.0.mlp.down_proj" in int4.int8
    assert "layers.0.mlp.gate_up_proj" in int4.int4_from_file and not int4.int4_quantized
    everything = load_model(mixed_q4k_model, quantization="int4_all")
    report = everything.quantization
    assert not report.int8
    assert "layers.0.self_attn.qkv_proj" in report.int4_quantized  # q, k from the file, v quantized here
    assert "layers.0.mlp.gate_up_proj" in report.int4_from_file
    reference = load_model(mixed_q4k_model, quantization="none", pack_cpu_weights=False)
    for name in ("self_attn.qkv_proj", "mlp.down_proj", "mlp.gate_up_proj"):
        got = everything.layers[0].get_submodule(name).dequantized()
        expected = reference.layers[0].get_submodule(name).weight
        assert (got - expected).abs().max() < 0.1 * expected.abs().max(), name


@pytest.mark.parametrize("quantization", ["int4", "int4_all", "int8"])
def test_packed_cache_gives_the_same_model_and_survives_damage(mixed_q4k_model, quantization, monkeypatch):
    import draftwise.loading.hf_folder as hf_folder
    from draftwise.quant.packed_cache import cache_path

    def logits(model):
        runner = ModelRunner(model, max_num_rows=1, max_len=64)
        return runner.forward([runner.allocate()], [[5, 17, 42, 99, 3]], [5]).logits

    path = cache_path(mixed_q4k_model, quantization)
    assert not path.exists()
    first = load_model(mixed_q4k_model, quantization=quantization)  # quantizes and writes the cache
    assert path.is_file()
    quantize = hf_folder.quantize_model
    monkeypatch.setattr(hf_folder, "quantize_model", lambda *args: pytest.fail("quantized despite the cache"))
    cached = load_model(mixed_q4k_model, quantization=quantization)  # reads it
    monkeypatch.setattr(hf_folder, "quantize_model", quantize)
    assert type(cached.lm_head) is type(first.lm_head) and cached.quantization == first.quantization
    assert torch.equal(logits(first), logits(cached))
    path.write_bytes(b"not a safetensors file")
    rebuilt = load_model(mixed_q4k_model, quantization=quantization)  # ignored, rewritten
    assert torch.equal(logits(first), logits(rebuilt))
    assert load_model(mixed_q4k_model, quantization=quantization).quantization == first.quantization


def test_weights_replaced_in_a_folder_are_packed_again_not_served_from_the_old_cache(tmp_path):
    """A user's folder, quantized once (the packed cache written into it), then a fine-tune saved over
    its weights: the next load must compute with the new weights."""
    import os

    from draftwise.quant.packed_cache import cache_path
    from tests.tiny_models import write_tiny_model

    def logits(model):
        runner = ModelRunner(model, max_num_rows=1, max_len=64)
        return runner.forward([runner.allocate()], [[5, 17, 42, 99, 3]], [5]).logits

    folder = write_tiny_model(tmp_path / "user", "qwen2", seed=3, hidden_size=256)
    old = logits(load_model(folder, quantization="int8"))
    assert cache_path(folder, "int8").is_file()
    write_tiny_model(tmp_path / "user", "qwen2", seed=4, hidden_size=256)  # same names and sizes
    for weights in folder.glob("model*.safetensors"):  # even where the clock gives it the old time,
        os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))  # any change counts
    new = logits(load_model(folder, quantization="int8"))
    fresh = tmp_path / "fresh"
    assert torch.equal(new, logits(load_model(write_tiny_model(fresh, "qwen2", seed=4, hidden_size=256),
                                              quantization="int8")))
    assert not torch.equal(new, old)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_native_kernel_is_exact_up_to_float32_accumulation(kind, monkeypatch):
    """bf16 x bf16 products are exact in float32, so against a float64 product of the same bf16
    inputs only the summation order differs: a layout or indexing bug shows as a large error.
    (int8 activations, where measured faster, have their own test: test_int8_activations.py.)"""
    if not has_bf16_kernels():
        pytest.skip("no bf16-activation kernels here (AVX-512 BF16 only)")
    monkeypatch.setattr("draftwise.quant.linear.int8_activations", lambda kind, out_features, in_features: False)
    torch.manual_seed(2)
    weight = torch.randn(66, 256) * 0.05
    layer = make_layer(kind, weight, None, native=True)
    x = torch.randn(11, 256).to(torch.bfloat16)
    expected = x.double() @ layer.dequantized().double().t()
    assert (layer(x.float()).double() - expected).abs().max() < 1e-5 * expected.abs().max()


def test_a_q4k_embedding_table_stays_int4_and_looks_up_exactly_the_files_values(mixed_q4k_model):
    from draftwise.model.memory import module_bytes
    from draftwise.quant.embedding import Int4Embedding

    reference = load_model(mixed_q4k_model, quantization="none", pack_cpu_weights=False)
    ids = torch.tensor([[0, 5, 17], [99, 3, 3]])
    for attempt in ("quantized now", "from the packed cache"):
        model = load_model(mixed_q4k_model, quantization="int4")
        assert isinstance(model.embed_tokens, Int4Embedding), attempt
        assert model.quantization.embedding == "int4 from the file's Q4_K"
        assert torch.equal(model.embed_tokens(ids), reference.embed_tokens(ids)), attempt
        assert torch.equal(model.embed_tokens.dequantized(), reference.embed_tokens.weight)
        assert module_bytes(model.embed_tokens) < reference.embed_tokens.weight.numel() * 4 / 5
    assert not isinstance(load_model(mixed_q4k_model, quantization="int8").embed_tokens, Int4Embedding)


def test_int4_all_quantizes_an_embedding_table_the_file_keeps_in_another_quantized_type(tmp_path, monkeypatch):
    from draftwise.loading.resolve import resolve_model
    from draftwise.quant.embedding import Int4Embedding
    from tests.tiny_models import write_tiny_gguf, write_tiny_model

    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    hf_folder = write_tiny_model(tmp_path / "wide", "qwen2", seed=3, hidden_size=256)
    folder = resolve_model(str(write_tiny_gguf(hf_folder, tmp_path / "q8.gguf", quantize_q8=True)), progress=False)
    int4 = load_model(folder, quantization="int4")
    assert int4.quantization.embedding == "float" and not isinstance(int4.embed_tokens, Int4Embedding)
    everything = load_model(folder, quantization="int4_all")
    assert everything.quantization.embedding == "int4 quantized here"
    table = load_model(folder, quantization="none", pack_cpu_weights=False).embed_tokens.weight
    assert (everything.embed_tokens.dequantized() - table).abs().max() < 0.1 * table.abs().max()
    float_folder = write_tiny_model(tmp_path / "float", "qwen2", seed=3, hidden_size=256)
    assert load_model(float_folder, quantization="int4_all").quantization.embedding == "float"


def test_a_new_kernel_build_removes_the_packed_caches_of_earlier_ones(mixed_q4k_model, monkeypatch):
    from draftwise.quant.packed_cache import cache_path
    from draftwise.quant.superblock_strips import SUPERBLOCKS_ENV

    path = cache_path(mixed_q4k_model, "int4")
    if native_kernels() is None:
        pytest.skip("only native kernel builds have earlier builds to remove")
    stale = path.with_name("packed-int4-native000000000000-torch0-cpu-f1.safetensors")
    other_mode = path.with_name("packed-int8-native000000000000-torch0-cpu-f1.safetensors")
    monkeypatch.setenv(SUPERBLOCKS_ENV, "0")
    other_layouts = cache_path(mixed_q4k_model, "int4")  # this build's, with the super-block kernels off
    monkeypatch.delenv(SUPERBLOCKS_ENV)
    assert other_layouts != path
    stale.write_bytes(b"x")
    other_mode.write_bytes(b"x")
    other_layouts.write_bytes(b"x")  # DRAFTWISE_SUPERBLOCK_KERNELS=0's cache: a benchmark's A/B keeps both
    load_model(mixed_q4k_model, quantization="int4")
    assert path.is_file() and not stale.exists() and other_mode.exists() and other_layouts.exists()
