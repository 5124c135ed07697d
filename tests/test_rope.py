"""RoPE and its context-extension variants (linear, llama3, YaRN) against Hugging Face transformers on
tiny random checkpoints saved with each config, well past their original context; the same variants
read from GGUF metadata and a GGUF's rope_freqs tensor; and the length-dependent variants refused."""

from __future__ import annotations

import pytest
import torch

from draftwise import LLM, SamplingParams
from draftwise.errors import ModelFormatError
from draftwise.loading.hf_folder import load_model
from draftwise.loading.gguf_file import GGUFFile
from tests.test_model_reference import reference_logits
from tests.tiny_models import write_tiny_gguf, write_tiny_model

TOKENS = [[(37 * i + 11) % 300 + 3 for i in range(300)]]  # 300 positions: past every original context below
VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn with mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                         "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "yarn with attention factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                   "attention_factor": 1.3},
}


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_scaled_rope_matches_transformers(variant, model_type, tmp_path):
    folder = write_tiny_model(tmp_path / variant.replace(" ", "_"), model_type, seed=2, rope_scaling=VARIANTS[variant])
    model = load_model(folder, pack_cpu_weights=False)
    assert model.config.rope_scaling is not None and model.config.rope_scaling.rope_type == VARIANTS[variant][
        "rope_type"]
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        got = model(tokens, torch.arange(tokens.shape[1])[None])
    torch.testing.assert_close(got, reference_logits(folder, TOKENS), rtol=1e-4, atol=1e-4)


def test_the_scaling_changes_the_logits(tmp_path):
    """(So that the comparison above tests the scaling, not plain RoPE twice.)"""
    plain = load_model(write_tiny_model(tmp_path / "plain", "llama", seed=2), pack_cpu_weights=False)
    scaled = load_model(write_tiny_model(tmp_path / "yarn", "llama", seed=2, rope_scaling=VARIANTS["yarn"]),
                        pack_cpu_weights=False)
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        difference = (plain(tokens, torch.arange(300)[None]) - scaled(tokens, torch.arange(300)[None])).abs().max()
    assert difference > 1e-2


def test_speculation_is_lossless_under_scaled_rope(tmp_path, drafting_pays):
    folder = write_tiny_model(tmp_path / "llama3", "llama", seed=2, rope_scaling=VARIANTS["llama3"])
    params = SamplingParams(temperature=0, max_tokens=40)
    prompt = {"prompt_token_ids": TOKENS[0][:100], "prompt": ""}
    plain = LLM(str(folder), max_model_len=512, progress=False).generate(prompt, params)[0]
    drafted = LLM(str(folder), max_model_len=512, progress=False, speculative={
        "method": "draft", "model": str(folder), "num_speculative_tokens": 4}).generate(prompt, params)[0]
    assert drafted.token_ids == plain.token_ids and drafted.metrics.spec.acceptance_rate == 1.0


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_length_dependent_rope_is_refused_by_name(kind, tmp_path):
    scaling = {"rope_type": kind, "factor": 2.0, "original_max_position_embeddings": 128,
               "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    folder = write_tiny_model(tmp_path / kind, "llama", seed=2, rope_scaling=scaling)
    with pytest.raises(ModelFormatError, match=f"RoPE scaling '{kind}' makes a position's rotation depend"):
        load_model(folder)


def test_gguf_rope_scaling_from_metadata_and_rope_freqs(tmp_path, gguf_cache, monkeypatch):
    """llama.cpp's `rope.scaling.*` metadata (yarn) and a `rope_freqs` tensor (llama3's factors)."""
    monkeypatch.setenv("DRAFTWISE_CACHE", str(gguf_cache))
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    yarn = write_tiny_model(tmp_path / "yarn", "llama", seed=2, rope_scaling=VARIANTS["yarn"])
    path = write_tiny_gguf(yarn, tmp_path / "yarn.gguf", metadata={
        "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 128.0})
    assert GGUFFile(path).config.rope_scaling.rope_type == "yarn"

    llama3 = write_tiny_model(tmp_path / "llama3", "llama", seed=2, rope_scaling=VARIANTS["llama3"])
    config = LlamaConfig.from_pretrained(llama3)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16))
    path3 = write_tiny_gguf(llama3, tmp_path / "llama3.gguf", extra_tensors={"rope_freqs.weight": plain / scaled})
    assert GGUFFile(path3).config.rope_scaling.freq_factors is not None
    for hf_folder, gguf_path in ((yarn, path), (llama3, path3)):
        expected = reference_logits(hf_folder, TOKENS)
        model = LLM(str(gguf_path), max_model_len=512, progress=False, quantization="none").model
        tokens = torch.tensor(TOKENS)
        with torch.no_grad():
            got = model(tokens, torch.arange(300)[None])
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
