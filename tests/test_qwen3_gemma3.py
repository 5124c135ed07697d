"""Qwen3, Qwen3-MoE and Gemma 3 (text) on tiny random checkpoints: logits against transformers, from
Hugging Face folders and from GGUF files laid out as llama.cpp writes them, and the lossless suite:
speculative output equal to plain decoding for every drafter, alone and batched, the target drafting
for itself accepting everything, and a row's logits the same alone, in a verification and in a batch.

Tiny Gemma 3's sliding window is 5 keys, so prompts, verification passes and answers all run past it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from draftwise import LLM
from draftwise.loading.convert import convert_gguf
from draftwise.loading.hf_folder import load_model, read_config
from draftwise.model.transformer import Transformer
from tests.lossless_suite import assert_row_logits_independent_of_pass, assert_speculation_equals_plain
from tests.test_model_reference import reference_logits
from tests.tiny_models import SLIDING_WINDOW, write_tiny_gguf, write_tiny_model

TOKENS = [[(31 * i + 7) % 300 + 3 for i in range(40)]]
PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog and", "for i in range(10):\n    print(",
           "x = np.zeros((3, 4))\nx = np.zeros((3, 4))\nx = np."]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe", "gemma3_text"])
def model_folder(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=4, num_layers=3)


@pytest.mark.parametrize("packed", [False, True])
def test_logits_match_transformers(model_folder, packed):
    model = load_model(model_folder, pack_cpu_weights=packed)
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        got = model(tokens, torch.arange(tokens.shape[1])[None])
    torch.testing.assert_close(got, reference_logits(model_folder, TOKENS), rtol=1e-4, atol=1e-4)


def test_gemma3_fields_change_the_output(tmp_path):
    """The window, the local RoPE base and the score scale each matter (so the comparison covers them)."""
    folder = write_tiny_model(tmp_path / "gemma", "gemma3_text", seed=4, num_layers=3)
    config = read_config(folder)
    assert config.sliding_window == SLIDING_WINDOW and config.is_sliding(0) and not config.is_sliding(2)
    base = load_model(folder, pack_cpu_weights=False)
    tokens, positions = torch.tensor(TOKENS), torch.arange(40)[None]
    with torch.no_grad():
        expected = base(tokens, positions)
        for change in ({"sliding_window": 0}, {"local_rope_theta": config.rope_theta},
                       {"query_pre_attn_scalar": None}):
            other = Transformer(dataclasses.replace(config, **change))
            other.load_state_dict(base.state_dict())
            assert not torch.allclose(other(tokens, positions), expected, atol=1e-3), change


def test_the_cache_attends_over_the_window_as_a_full_pass_does(model_folder):
    """Prefill, then one token at a time and a verification of 6 through the paged cache (the native
    kernel), against one whole-sequence pass."""
    llm = LLM(str(model_folder), max_model_len=256, max_num_seqs=2, progress=False, quantization="none")
    runner, ids = llm.runner, TOKENS[0]
    row = runner.allocate()
    logits = [runner.forward([row], [ids[:12]], [12]).logits]
    for token in ids[12:30]:
        logits.append(runner.forward([row], [[token]], [1]).logits)
    logits.append(runner.forward([row], [ids[30:36]], [6]).logits)
    got = torch.cat([step.reshape(-1, step.shape[-1]) for step in logits])
    torch.testing.assert_close(got, reference_logits(model_folder, [ids[:36]])[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_a_rows_logits_do_not_depend_on_its_pass(model_folder, quantization):
    """The same token's logits alone, as the last of a 5-token verification, and beside other rows."""
    assert_row_logits_independent_of_pass(model_folder, quantization, TOKENS[0])


@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("drafter", ["draft=target", "draft=target tree", "random draft", "ngram", "suffix",
                                     "layer_skip"])
def test_speculation_equals_plain(model_folder, drafter, quantization, random_draft, drafting_pays):
    assert_speculation_equals_plain(model_folder, drafter, quantization, random_draft, PROMPTS)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "gemma3_text"])
def test_gguf_as_llama_cpp_writes_it_reads_back(model_type, tmp_path):
    """Tensor names (Gemma's ffn_norm is the MLP's input norm), the norms' stored 1 + w, QK-norms,
    Gemma's constants that the file does not carry, and Qwen3-MoE's renormalised routing."""
    folder = write_tiny_model(tmp_path / "hf", model_type, seed=5, num_layers=6, gemma_as_llama_cpp=True)
    path = write_tiny_gguf(folder, tmp_path / f"{model_type}.gguf")
    converted = convert_gguf(path, tmp_path / "converted", progress=False)
    expected = read_config(folder)
    assert read_config(converted) == dataclasses.replace(expected, rms_norm_eps=read_config(converted).rms_norm_eps)
    model = load_model(converted, pack_cpu_weights=False)
    with torch.no_grad():
        got = model(torch.tensor(TOKENS), torch.arange(40)[None])
    torch.testing.assert_close(got, reference_logits(folder, TOKENS), rtol=1e-4, atol=1e-4)


def test_multimodal_gemma3_and_soft_capping_are_refused_by_name(tmp_path):
    import json

    from draftwise.errors import ModelFormatError
    from draftwise.model.config import ModelConfig

    with pytest.raises(ModelFormatError, match="multimodal"):
        ModelConfig.from_hf_dict({"model_type": "gemma3", "text_config": {}})
    folder = write_tiny_model(tmp_path / "gemma", "gemma3_text", seed=4, num_layers=3)
    config = json.loads((folder / "config.json").read_text())
    with pytest.raises(ModelFormatError, match="final_logit_softcapping"):
        ModelConfig.from_hf_dict({**config, "final_logit_softcapping": 30.0})
