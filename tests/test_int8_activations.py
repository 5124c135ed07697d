"""int4 and int8 layers with int8 activations (VNNI): the kernel against its own quantization computed here,
row independence, the verification property on a model, and the per-shape choice measured once."""

import json

import pytest
import torch

from draftwise.loading.hf_folder import load_model
from draftwise.quant import activation_choice
from draftwise.quant.linear import Int4Linear, Int8Linear, quantize_int4_groups
from draftwise.quant.native import has_bf16_kernels, kernels as native_kernels
from draftwise.runner.model_runner import ModelRunner
from tests.test_quantization import verify_pass_and_single_steps
from tests.tiny_models import write_tiny_model

BLOCK = activation_choice.ACTIVATION_BLOCK

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="native low-bit kernels unavailable here")


@pytest.fixture
def int8_activations_on(monkeypatch):
    """Every quantized layer built in the test takes an int8-activation kernel, whatever timing says."""
    monkeypatch.setattr("draftwise.quant.linear.int8_activations", lambda kind, out_features, in_features: True)


def make_layer(kind: str, out_features: int, in_features: int, scale: float = 1.0) -> Int4Linear | Int8Linear:
    weight = torch.randn(out_features, in_features) * scale
    layer = Int8Linear(weight, None) if kind == "int8" else Int4Linear(*quantize_int4_groups(weight), None)
    assert layer.int8_activations
    return layer


def quantized_reference(x: torch.Tensor, layer: Int4Linear | Int8Linear, block: int) -> torch.Tensor:
    """What the kernel must compute, in float64 from the same int8 activations: each row in blocks,
    scale = max|x| / 127, q = round-half-even(x * (127 / max|x|)) in float32."""
    rows, features = x.shape
    blocks = x.view(rows, features // block, block)  # [M, K/block, block]
    max_abs = blocks.abs().amax(dim=-1)  # [M, K/block]
    inverse = torch.where(max_abs > 0, 127 / max_abs, torch.zeros_like(max_abs))
    q = torch.round(blocks * inverse[..., None]).clamp(-127, 127)
    dequantized = (q.double() * (max_abs / 127).double()[..., None]).view(rows, features)
    return dequantized @ layer.dequantized().double().t()


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_the_kernel_computes_its_own_quantization_exactly_up_to_float32_accumulation(kind, int8_activations_on):
    torch.manual_seed(3)
    layer = make_layer(kind, 67, 384, scale=0.05)  # 67 channels: a partial quad and strip
    x = torch.randn(11, 384) * torch.linspace(0.01, 30, 384)  # blocks of very different ranges
    x[3, 128:256] = 0  # an all-zero block
    expected = quantized_reference(x, layer, BLOCK)
    assert (layer(x).double() - expected).abs().max() < 1e-5 * expected.abs().max()
    # ... and the quantization costs little against the exact product of float activations
    exact = x.double() @ layer.dequantized().double().t()
    assert (layer(x).double() - exact).norm() < 0.02 * exact.norm()


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_int8_activation_rows_are_independent_of_the_pass(kind, int8_activations_on):
    torch.manual_seed(4)
    layer = make_layer(kind, 161, 256)  # odd channel count: the last quad and strip are partial
    x = torch.randn(70, 256)  # beyond one 8-row tile and one 64-row block
    alone = [layer(x[i:i + 1]) for i in range(70)]
    for rows in (2, 3, 5, 8, 9, 17, 70):
        together = layer(x[:rows])
        assert all(torch.equal(together[i:i + 1], alone[i]) for i in range(rows))


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_a_verification_pass_equals_single_steps_with_int8_activations(quantization, int8_activations_on, tmp_path):
    folder = write_tiny_model(tmp_path, "qwen2", seed=2, hidden_size=128)  # every K a multiple of 32
    model = load_model(folder, quantization=quantization)
    layers = [layer for layer in model.modules() if isinstance(layer, (Int4Linear, Int8Linear))]
    assert layers and all(layer.int8_activations for layer in layers)
    runner = ModelRunner(model, max_num_rows=2, max_len=128)
    together, steps, _ = verify_pass_and_single_steps(runner, [5, 17, 42, 99, 3, 250, 7], [8, 120, 33, 61, 2, 77, 14, 9])
    assert torch.equal(together, steps)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_cached_layer_in_the_other_layout_is_repacked_not_misread(kind, monkeypatch):
    """The packed-weight cache may hold the layout of an earlier choice: the layer takes today's."""
    if not has_bf16_kernels():
        pytest.skip("this machine's build has one layout (the int8-activation kernels only)")
    torch.manual_seed(5)
    weight = torch.randn(40, 128)
    build = (lambda: Int8Linear(weight, None)) if kind == "int8" else (lambda: Int4Linear(*quantize_int4_groups(weight), None))
    for cached_choice in (True, False):
        monkeypatch.setattr("draftwise.quant.linear.int8_activations", lambda kind, n, k: cached_choice)
        cached = build().packed_state()
        monkeypatch.setattr("draftwise.quant.linear.int8_activations", lambda kind, n, k: not cached_choice)
        fresh = build()
        loaded = type(fresh).from_packed(cached, None)
        assert loaded.int8_activations == fresh.int8_activations == (not cached_choice)
        x = torch.randn(3, 128)
        assert torch.equal(loaded(x), fresh(x))


def test_the_choice_is_measured_once_per_shape_and_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(activation_choice, "has_bf16_kernels", lambda: True)  # (a build with both kernels)
    path = tmp_path / "choices.json"
    monkeypatch.setattr(activation_choice, "choices_path", lambda: path)
    activation_choice._choice.cache_clear()
    measured = []

    def fake_measure(kind, out_features, in_features):
        measured.append((out_features, in_features))
        return {"int8": out_features > 100, "int8 1": 0.1}

    monkeypatch.setattr(activation_choice, "measure", fake_measure)
    assert activation_choice.int8_activations("int8", 200, 256) and not activation_choice.int8_activations("int8", 64, 256)
    assert activation_choice.int8_activations("int8", 200, 256)
    assert measured == [(200, 256), (64, 256)]
    assert json.loads(path.read_text())["int8 200x256"]["int8"] is True
    activation_choice._choice.cache_clear()  # another process: reads the file, measures nothing
    assert activation_choice.int8_activations("int8", 200, 256) and measured == [(200, 256), (64, 256)]
    assert not activation_choice.int8_activations("int8", 200, 200)  # K not a multiple of 32: bf16, unmeasured
    monkeypatch.setenv(activation_choice.ACTIVATIONS_ENV, "0")
    assert not activation_choice.int8_activations("int8", 200, 256)
    activation_choice._choice.cache_clear()


def test_a_build_with_only_the_int8_activation_kernels_takes_them_without_measuring(monkeypatch):
    """AVX2: no bf16 kernel to compare with, so every layer whose K fits takes int8 activations."""
    monkeypatch.setattr(activation_choice, "has_bf16_kernels", lambda: False)
    monkeypatch.setattr(activation_choice, "measure", lambda *shape: pytest.fail("measured"))
    assert activation_choice.int8_activations("int4", 200, 256) and activation_choice.int8_activations("int8", 64, 96)
    assert not activation_choice.int8_activations("int4", 200, 200)  # K not a multiple of 32: PyTorch's kernel


def test_a_burst_of_load_during_the_measurement_does_not_decide_the_choice():
    """The machine is busy (every run 10x slower) for the first half of the runs: the kernel that is
    faster on a quiet machine must still come out faster (timing one kernel's runs all before the
    other's read the busy kernel as the slow one)."""
    now, runs = [0.0], [0]

    def kernel(seconds):
        def run():
            now[0] += seconds * (10 if runs[0] < 2 + activation_choice.ROUNDS else 1)  # (2: the untimed runs)
            runs[0] += 1
        return run

    fast, slow = activation_choice.fastest_alternating(kernel(1.0), kernel(2.0), clock=lambda: now[0])
    assert (fast, slow) == (1.0, 2.0)


def test_the_kernels_are_timed_on_one_thread_and_the_count_restored(monkeypatch):
    """On a busy machine runs on more threads wait at barriers for descheduled threads and time
    nothing but the scheduler (the choice came out bf16, 4-5x slower, for real layers)."""
    if not has_bf16_kernels():
        pytest.skip("no bf16-activation kernels here (AVX-512 BF16 only)")
    counts = []
    timed = activation_choice.fastest_alternating
    monkeypatch.setattr(activation_choice, "fastest_alternating",
                        lambda first, second: counts.append(torch.get_num_threads()) or timed(first, second))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        activation_choice.measure("int4", 64, 64)
        assert counts == [1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_real_measurement_times_both_kernels(kind):
    if not has_bf16_kernels():
        pytest.skip("no bf16-activation kernels here (AVX-512 BF16 only)")
    result = activation_choice.measure(kind, 256, 512)
    assert set(result) == {"int8", "bf16 1", "int8 1", f"bf16 {activation_choice.VERIFY_ROWS}",
                           f"int8 {activation_choice.VERIFY_ROWS}"}
    assert all(result[name] > 0 for name in result if name != "int8")


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("where", [0, 5, 31, 40])
def test_a_nan_or_inf_in_the_activations_reaches_the_outputs(kind, where, int8_activations_on):
    """As in a float matmul, a NaN (or inf) input makes the outputs NaN, wherever it sits in its group
    (it used to drop out of the group's max and leave a finite answer); rows without one unchanged."""
    layer = make_layer(kind, 48, 64)
    assert layer.int8_activations
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    clean = layer(x)
    for bad in (float("nan"), float("inf"), float("-inf")):
        poisoned = x.clone()
        poisoned[1, where] = bad
        out = layer(poisoned)
        assert torch.isnan(out[1]).all(), (bad, out[1][:4])
        assert torch.equal(out[0], clean[0]) and torch.equal(out[2], clean[2])


def test_an_int4_layer_the_bf16_kernels_cannot_take_uses_int8_activations_unmeasured(monkeypatch):
    """K a multiple of 32 but not 64: on a machine with the bf16 kernels too, the choice must not
    time the bf16 kernel (it refuses that K) but take the int8-activation kernels."""
    monkeypatch.setattr(activation_choice, "has_bf16_kernels", lambda: True)
    monkeypatch.setattr(activation_choice, "measure", lambda *shape: pytest.fail(f"measured {shape}"))
    activation_choice._choice.cache_clear()
    assert activation_choice.int8_activations("int4", 64, 96)
    assert activation_choice.int8_activations("int8", 64, 160)
