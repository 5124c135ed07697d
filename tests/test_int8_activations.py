"""int8 layers with int8 activations (VNNI): the kernel against its own quantization computed here,
row independence, the verification property on a model, and the per-shape choice measured once."""

import json

import pytest
import torch

from draftwise.loading.hf_folder import load_model
from draftwise.quant import activation_choice
from draftwise.quant.linear import Int8Linear
from draftwise.quant.native import kernels as native_kernels
from draftwise.runner.model_runner import ModelRunner
from tests.test_quantization import verify_pass_and_single_steps
from tests.tiny_models import write_tiny_model

BLOCK = activation_choice.ACTIVATION_BLOCK

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="native low-bit kernels unavailable here")


@pytest.fixture
def int8_activations_on(monkeypatch):
    """Every int8 layer built in the test takes the int8-activation kernel, whatever timing says."""
    monkeypatch.setattr("draftwise.quant.linear.int8_activations", lambda out_features, in_features: True)


def quantized_reference(x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
    """What the kernel must compute, in float64 from the same int8 activations: each row in blocks of
    128, scale = max|x| / 127, q = round-half-even(x * (127 / max|x|)) in float32."""
    rows, features = x.shape
    blocks = x.view(rows, features // BLOCK, BLOCK)  # [M, K/128, 128]
    max_abs = blocks.abs().amax(dim=-1)  # [M, K/128]
    inverse = torch.where(max_abs > 0, 127 / max_abs, torch.zeros_like(max_abs))
    q = torch.round(blocks * inverse[..., None]).clamp(-127, 127)
    dequantized = (q.double() * (max_abs / 127).double()[..., None]).view(rows, features)
    return dequantized @ (layer.weight_int8.double() * layer.scales_float.double()[:, None]).t()


def test_the_kernel_computes_its_own_quantization_exactly_up_to_float32_accumulation(int8_activations_on):
    torch.manual_seed(3)
    layer = Int8Linear(torch.randn(67, 384) * 0.05, None)
    assert layer.int8_activations
    x = torch.randn(11, 384) * torch.linspace(0.01, 30, 384)  # blocks of very different ranges
    x[3, 128:256] = 0  # an all-zero block
    expected = quantized_reference(x, layer)
    assert (layer(x).double() - expected).abs().max() < 1e-5 * expected.abs().max()
    # ... and the quantization costs little against the exact product of float activations
    exact = x.double() @ layer.dequantized().double().t()
    assert (layer(x).double() - exact).norm() < 0.02 * exact.norm()


def test_int8_activation_rows_are_independent_of_the_pass(int8_activations_on):
    torch.manual_seed(4)
    layer = Int8Linear(torch.randn(161, 256), None)  # odd channel count: the last quad is partial
    x = torch.randn(70, 256)  # beyond one 8-row tile and one 64-row block
    alone = [layer(x[i:i + 1]) for i in range(70)]
    for rows in (2, 5, 8, 9, 17, 70):
        together = layer(x[:rows])
        assert all(torch.equal(together[i:i + 1], alone[i]) for i in range(rows))


def test_a_verification_pass_equals_single_steps_with_int8_activations(int8_activations_on, tmp_path):
    folder = write_tiny_model(tmp_path, "qwen2", seed=2, hidden_size=128)  # every K a multiple of 128
    model = load_model(folder, quantization="int8")
    assert all(layer.int8_activations for layer in model.modules() if isinstance(layer, Int8Linear))
    runner = ModelRunner(model, max_num_rows=2, max_len=128)
    together, steps, _ = verify_pass_and_single_steps(runner, [5, 17, 42, 99, 3, 250, 7], [8, 120, 33, 61, 2, 77, 14, 9])
    assert torch.equal(together, steps)


def test_the_choice_is_measured_once_per_shape_and_cached(tmp_path, monkeypatch):
    path = tmp_path / "choices.json"
    monkeypatch.setattr(activation_choice, "choices_path", lambda: path)
    activation_choice._choice.cache_clear()
    measured = []

    def fake_measure(out_features, in_features):
        measured.append((out_features, in_features))
        return {"int8": out_features > 100, "int8 1": 0.1}

    monkeypatch.setattr(activation_choice, "measure", fake_measure)
    assert activation_choice.int8_activations(200, 256) and not activation_choice.int8_activations(64, 256)
    assert activation_choice.int8_activations(200, 256)
    assert measured == [(200, 256), (64, 256)]
    assert json.loads(path.read_text())["200x256"]["int8"] is True
    activation_choice._choice.cache_clear()  # another process: reads the file, measures nothing
    assert activation_choice.int8_activations(200, 256) and measured == [(200, 256), (64, 256)]
    assert not activation_choice.int8_activations(200, 200)  # K not a multiple of 128: bf16, unmeasured
    monkeypatch.setenv(activation_choice.ACTIVATIONS_ENV, "0")
    assert not activation_choice.int8_activations(200, 256)
    activation_choice._choice.cache_clear()


def test_a_real_measurement_times_both_kernels():
    result = activation_choice.measure(256, 512)
    assert set(result) == {"int8", "bf16 1", "int8 1", f"bf16 {activation_choice.VERIFY_ROWS}",
                           f"int8 {activation_choice.VERIFY_ROWS}"}
    assert all(result[name] > 0 for name in result if name != "int8")
