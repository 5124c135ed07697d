"""Mixture-of-experts targets (Mixtral, Qwen2-MoE) on tiny random checkpoints: logits against
transformers, every layer's routing exercised, and the lossless suite: speculative output equal to
plain decoding for every drafter, alone and batched, the target drafting for itself accepting
everything, int4 and fp32, and a row's logits the same alone, in a verification and in a batch."""

from __future__ import annotations

import pytest
import torch

from draftwise import LLM
from draftwise.loading.hf_folder import load_model
from draftwise.model.moe import SparseMoE
from tests.lossless_suite import assert_row_logits_independent_of_pass, assert_speculation_equals_plain
from tests.test_model_reference import reference_logits
from tests.tiny_models import write_tiny_model

TOKENS = [[(31 * i + 7) % 300 + 3 for i in range(40)]]
PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):\n    print(",
           "x = np.zeros((3, 4))\nx = np.zeros((3, 4))\nx = np."]


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def moe_model(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=4, num_layers=2)


@pytest.mark.parametrize("packed", [False, True])
def test_moe_logits_match_transformers(moe_model, packed):
    model = load_model(moe_model, pack_cpu_weights=packed)
    assert any(isinstance(layer.mlp, SparseMoE) for layer in model.layers)
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        got = model(tokens, torch.arange(tokens.shape[1])[None])
    torch.testing.assert_close(got, reference_logits(moe_model, TOKENS), rtol=1e-4, atol=1e-4)


def test_every_expert_is_routed_to(moe_model):
    """(So that the comparison covers the routing, not one expert's weights.)"""
    model = load_model(moe_model, pack_cpu_weights=False)
    block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE))
    hidden = model.embed_tokens(torch.tensor(TOKENS))[0]
    with torch.no_grad():
        chosen = torch.softmax(block.gate(hidden), -1).topk(block.top_k).indices.unique()
    assert len(chosen) == len(block.experts)


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_a_rows_logits_do_not_depend_on_its_pass(moe_model, quantization):
    """The same token's logits alone, as the last of a 5-token verification, and beside other rows."""
    assert_row_logits_independent_of_pass(moe_model, quantization, TOKENS[0])


@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("drafter", ["draft=target", "random draft", "ngram", "suffix"])
def test_speculation_on_a_moe_target_equals_plain(moe_model, drafter, quantization, random_draft, drafting_pays):
    assert_speculation_equals_plain(moe_model, drafter, quantization, random_draft, PROMPTS)


def test_moe_from_gguf(moe_model, tmp_path_factory, gguf_cache, monkeypatch):
    """llama.cpp's layout: the experts of a layer stacked [E, out, in] (Mixtral as `llama` with
    experts, Qwen2-MoE as `qwen2moe`); read back, the same model as the HF folder."""
    from draftwise.loading.gguf_file import GGUFFile
    from tests.tiny_models import write_tiny_gguf

    monkeypatch.setenv("DRAFTWISE_CACHE", str(gguf_cache))
    path = write_tiny_gguf(moe_model, tmp_path_factory.mktemp("gguf") / "moe.gguf")
    config = GGUFFile(path).config
    assert config.num_experts == 4 and config.model_type in ("mixtral", "qwen2_moe")
    tokens = torch.tensor(TOKENS)
    expected = load_model(moe_model, pack_cpu_weights=False)
    got = LLM(str(path), max_model_len=256, progress=False, quantization="none")
    with torch.no_grad():
        want = expected(tokens, torch.arange(tokens.shape[1])[None])
        have = got.model(tokens, torch.arange(tokens.shape[1])[None])
    torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4)


def test_the_cost_profile_times_a_moe_targets_passes(moe_model):
    """Verifying more tokens wakes more experts: the profile times the MoE target's own passes (what
    the controller and the planner plan with), and each is a real pass of this model."""
    from draftwise.speculative.control.profile import measure

    llm = LLM(str(moe_model), max_model_len=256, progress=False)
    costs = measure(llm.runner, None, llm.tokenizer, 0)
    assert set(costs.target) >= {1, 2, 4, 8} and all(seconds > 0 for seconds in costs.target.values())


def test_the_shared_experts_gate_of_a_row_does_not_depend_on_the_rows_beside_it():
    """(torch.sigmoid computes a tensor's tail with scalar code: on an AVX2 CPU a [N, 1] call rounded
    some rows otherwise than the same rows alone, which broke the row-independence test above.)"""
    from draftwise.model.moe import rowwise_sigmoid

    gate = torch.randn(1100, 1, generator=torch.Generator().manual_seed(0)) * 4
    alone = torch.cat([rowwise_sigmoid(gate[i:i + 1]) for i in range(len(gate))])
    for rows in (1, 5, 17, 600, 1100):
        assert torch.equal(rowwise_sigmoid(gate[:rows]), alone[:rows]), rows
    assert torch.allclose(alone, torch.sigmoid(gate), rtol=1e-6, atol=0)


def test_a_moe_model_is_never_captured_in_a_cuda_graph(moe_model):
    """Its routing reads the chosen experts back to the host mid-pass: "auto" steps it eagerly where
    it would capture a dense model's step, and "graph" / "compile" are refused by name."""
    from types import SimpleNamespace

    from draftwise.errors import InvalidParameterError
    from draftwise.loading.hf_folder import load_model
    from draftwise.runner.model_runner import ModelRunner, _resolve_step_mode

    gpu_cache = SimpleNamespace(keys=SimpleNamespace(device=torch.device("cuda")), kernel=object())
    assert _resolve_step_mode("auto", gpu_cache) == "graph"
    assert _resolve_step_mode("auto", gpu_cache, routes_on_host=True) is None
    model = load_model(moe_model)
    for mode in ("graph", "compile"):
        with pytest.raises(InvalidParameterError, match="mixture-of-experts"):
            ModelRunner(model, 2, 64, step_mode=mode)
