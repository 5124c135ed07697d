"""Native decoder layers (`draftwise/model/native_decoder.py`) compute the Python layers' bits: the same
passes (a ragged prefill, chains of 1 and 3 tokens, a token tree) give bit-identical logits and KV
cache contents with the native layers on and off, for float, int4 and int8 weights, with QKV bias
(Qwen2) and with QK-norm (Qwen3); a layer with no native form (a mixture of experts) keeps Python."""

import pytest
import torch

from draftwise import LLM
from draftwise.model import native_decoder
from draftwise.model.part_changes import part_changes
from draftwise.model.transformer import DecoderLayer
from tests.tiny_models import write_tiny_model

pytestmark = pytest.mark.skipif(native_decoder.decoder_module() is None, reason="no native kernels on this machine")


def passes(llm):
    """Logits of a fixed sequence of passes over two rows, and the cache contents they wrote."""
    runner = llm.runner
    rows = [runner.allocate(), runner.allocate()]
    try:
        out = [runner.forward(rows, [list(range(5, 40)), list(range(50, 61))], [1, 1]).logits]
        out.append(runner.forward(rows, [[7], [9]], [1, 1]).logits)
        out.append(runner.forward(rows, [[11, 12, 13], [14]], [3, 1]).logits)
        out.append(runner.forward(rows, [[21, 22, 23, 24], [25, 26]], [4, 2], parents=[[-1, 0, 0, 1], None]).logits)
        written = [runner.blocks.slot(row, p) for row in rows for p in range(runner.blocks.lengths[row])]
        out += [runner.cache.keys[:, written].clone(), runner.cache.values[:, written].clone()]
        return out
    finally:
        for row in rows:
            runner.free(row)


def native_and_python(llm):
    model = llm.runner.model
    model.native_layers = True
    native = passes(llm)
    model.native_layers = False
    try:
        python = passes(llm)
    finally:
        model.native_layers = True
    return native, python


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.mark.parametrize("model_name", ["tiny_qwen", "tiny_qwen3"])
@pytest.mark.parametrize("quantization", ["none", "int4", "int8"])
def test_native_layers_compute_the_python_layers_bits(request, model_name, quantization, monkeypatch):
    llm = LLM(str(request.getfixturevalue(model_name)), max_model_len=128, max_num_seqs=2, progress=False,
              quantization=quantization, adaptive_threads=False)
    model = llm.runner.model
    assert all(model.native_layer(i) is not None for i in range(len(model.layers)))
    native, python = native_and_python(llm)

    def python_layer_called(*args, **kwargs):
        raise AssertionError("a Python layer ran while native layers were on")

    monkeypatch.setattr(DecoderLayer, "forward", python_layer_called)
    model.native_layers = True
    assert all(torch.equal(a, b) for a, b in zip(passes(llm), native))  # the native passes never touch Python layers
    monkeypatch.undo()
    for index, (a, b) in enumerate(zip(native, python)):
        assert torch.equal(a, b), f"output {index}: max |diff| {(a - b).abs().max().item():.3g}"


def test_a_replaced_part_rebuilds_the_native_layer(tiny_qwen):
    llm = LLM(str(tiny_qwen), max_model_len=128, max_num_seqs=2, progress=False, quantization="none")
    model = llm.runner.model
    before = model.native_layer(0)
    assert model.native_layer(0) is before
    mlp = model.layers[0].mlp
    mlp.down_proj = torch.nn.Linear(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False)
    torch.nn.init.zeros_(mlp.down_proj.weight)
    assert model.native_layer(0) is not before
    native, python = native_and_python(llm)  # the new (zero) weights in both paths
    assert all(torch.equal(a, b) for a, b in zip(native, python))


def test_passes_look_at_a_layers_parts_only_after_some_part_was_assigned(tiny_qwen, monkeypatch):
    llm = LLM(str(tiny_qwen), max_model_len=128, max_num_seqs=2, progress=False, quantization="int4")
    model = llm.runner.model
    passes(llm)  # (every native layer built)
    changes, before = part_changes(), model.native_layer(0)
    looked_at = []
    original = DecoderLayer.__getattr__
    monkeypatch.setattr(DecoderLayer, "__getattr__", lambda self, name: looked_at.append(name) or original(self, name))
    passes(llm)
    assert part_changes() == changes and looked_at == []  # passes assign nothing; no layer's parts read
    model.layers[0].post_attention_layernorm.weight = torch.nn.Parameter(torch.zeros(model.config.hidden_size))
    assert part_changes() > changes
    assert model.native_layer(0) is not before
    native, python = native_and_python(llm)  # (rebuilt with the new weight: both paths compute it)
    assert all(torch.equal(a, b) for a, b in zip(native, python))


@pytest.mark.parametrize("model_type", ["qwen2_moe", "gemma3_text"])
def test_layers_without_a_native_form_run_in_python(tmp_path, model_type):
    llm = LLM(str(write_tiny_model(tmp_path / model_type, model_type)), max_model_len=128, max_num_seqs=2,
              progress=False, quantization="none")
    model = llm.runner.model
    python_layers = [i for i in range(len(model.layers)) if model.native_layer(i) is None]
    expected = [i for i in range(len(model.layers))
                if model.config.is_sparse(i) or model.config.sandwich_norms]  # experts; Gemma's norms and GELU
    assert python_layers == expected and expected
    native, python = native_and_python(llm)  # (dense layers of the mixture native, the rest Python)
    assert all(torch.equal(a, b) for a, b in zip(native, python))
