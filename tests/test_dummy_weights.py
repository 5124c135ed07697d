"""load_format="dummy": random weights of a model's real shape from its config.json and tokenizer alone."""

import shutil

import pytest

from draftwise import LLM, SamplingParams
from draftwise.errors import InvalidParameterError


@pytest.fixture(scope="module")
def config_only(tiny_qwen, tmp_path_factory):
    """The tiny model's folder without its weights: what travels to a machine that can fetch nothing."""
    folder = tmp_path_factory.mktemp("config-only")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_qwen / name, folder / name)
    return folder


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_dummy_weights_load_without_weight_files_and_are_reproducible(config_only, quantization):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = LLM(str(config_only), load_format="dummy", max_model_len=128, progress=False, quantization=quantization)
    second = LLM(str(config_only), load_format="dummy", max_model_len=128, progress=False, quantization=quantization)
    out = first.generate("def add(a, b):", params)[0]
    assert len(out.token_ids) == 12 and out.token_ids == second.generate("def add(a, b):", params)[0].token_ids
    assert first.model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.2)


def test_dummy_weights_speculate_losslessly(config_only):
    llm = LLM(str(config_only), load_format="dummy", max_model_len=128, progress=False,
              speculative={"method": "draft", "model": str(config_only), "num_speculative_tokens": 3,
                           "adaptive": False})
    plain = LLM(str(config_only), load_format="dummy", max_model_len=128, progress=False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert llm.generate("x = 1", params)[0].token_ids == plain.generate("x = 1", params)[0].token_ids


def test_real_weights_are_required_without_dummy(config_only):
    with pytest.raises(Exception, match="safetensors"):
        LLM(str(config_only), max_model_len=128, progress=False, quantization="none")
    with pytest.raises(InvalidParameterError, match="load_format"):
        LLM(str(config_only), load_format="random", max_model_len=128, progress=False)
