"""A decoder layer's last residual add is left to the next layer's input norm (`forward_unadded`), so
that on the GPU the add and the norm are one kernel. The stream it computes must be, bit for bit, the
one the layers compute called one after another, at every captured layer and after a partial pass."""

import pytest
import torch

from draftwise.loading.hf_folder import load_model
from draftwise.model import transformer as transformer_module


@pytest.fixture(scope="module")
def model(tiny_qwen):
    model = load_model(tiny_qwen, quantization="none")
    model.native_layers = False  # the Python layers (the GPU's path), not the CPU's native ones
    return model


def layer_by_layer(model, token_ids, positions, count):
    """The residual stream after each of the first `count` layers, each layer called as a module."""
    x = model.embed_tokens(token_ids)
    cos, sin = model.rotary(positions, x.dtype)
    streams = []
    for layer in list(model.layers)[:count]:
        x = layer(x, positions, cos, sin, None)
        streams.append(x)
    return streams


@torch.inference_mode()
def test_the_deferred_adds_compute_the_layers_stream_bit_for_bit(model):
    token_ids = torch.tensor([[5, 17, 99, 3, 250, 41, 8]])  # [1, 7]
    positions = torch.arange(7)[None, :]
    layers = len(model.layers)
    assert layers >= 2
    expected = layer_by_layer(model, token_ids, positions, layers)
    hidden, captured = model.hidden_states(token_ids, positions, capture_layers=tuple(range(layers)))
    assert torch.equal(hidden, expected[-1])
    for index in range(layers):
        assert torch.equal(captured[index], expected[index]), f"layer {index}"
    partial, _ = model.hidden_states(token_ids, positions, num_layers=1)
    assert torch.equal(partial, expected[0])


@torch.inference_mode()
def test_each_later_layer_adds_the_mlp_output_in_its_input_norm(model, monkeypatch):
    """The add goes through `add_and_norm` (the GPU's one kernel): two calls a layer after the first."""
    calls = []
    original = transformer_module.add_and_norm

    def counting(x, delta, norm):
        calls.append(norm)
        return original(x, delta, norm)

    monkeypatch.setattr(transformer_module, "add_and_norm", counting)
    token_ids = torch.tensor([[5, 17, 99]])
    model.hidden_states(token_ids, torch.arange(3)[None, :])
    layers = list(model.layers)
    assert calls.count(layers[0].input_layernorm) == 0
    for layer in layers[1:]:
        assert calls.count(layer.input_layernorm) == 1
    for layer in layers:
        assert calls.count(layer.post_attention_layernorm) == 1


@torch.inference_mode()
def test_a_hooked_layer_is_called_as_a_module(model):
    """Forward hooks (the divergence tool's) see a layer's output: that layer is not deferred."""
    seen = []
    handle = model.layers[0].register_forward_hook(lambda module, inputs, output: seen.append(output))
    try:
        token_ids = torch.tensor([[5, 17, 99]])
        positions = torch.arange(3)[None, :]
        _, captured = model.hidden_states(token_ids, positions, capture_layers=(0,))
    finally:
        handle.remove()
    assert len(seen) == 1 and torch.equal(seen[0], captured[0])
