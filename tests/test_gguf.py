"""GGUF conversion: tiny files written like llama.cpp's converter load to the same logits."""

import numpy as np
import pytest
import torch

from draftwise.errors import ModelFormatError, ModelNotFoundError
from draftwise.loading.gguf_file import GGUFFile, permute_rotary, unpermute_rotary
from draftwise.loading.hf_folder import load_model
from draftwise.loading.resolve import resolve_model
from draftwise.text.tokenizer import Tokenizer

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
POSITIONS = torch.arange(7)[None]


def logits(folder):
    with torch.no_grad():
        return load_model(folder)(PROMPT, POSITIONS)


def test_unpermute_inverts_llama_cpp_permutation():
    weight = np.arange(8 * 3 * 5, dtype=np.float32).reshape(8 * 3, 5)
    np.testing.assert_array_equal(unpermute_rotary(permute_rotary(weight, 3), 3), weight)
    assert not np.array_equal(permute_rotary(weight, 3), weight)


@pytest.mark.parametrize("name", ["tiny_qwen", "tiny_llama"])
def test_gguf_converts_to_the_same_model(request, name, gguf_cache, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_CACHE", str(gguf_cache))
    hf_folder = request.getfixturevalue(name)
    gguf_path = request.getfixturevalue(f"{name}_gguf")
    converted = resolve_model(str(gguf_path), progress=False)
    torch.testing.assert_close(logits(converted), logits(hf_folder), rtol=1e-5, atol=1e-5)
    assert resolve_model(str(gguf_path), progress=False) == converted  # cached, not converted again


def test_a_conversion_waits_for_another_of_the_same_file_and_takes_its_result(tiny_qwen_gguf, tmp_path, monkeypatch):
    """Two processes converting one file (a benchmark's configs starting together) take turns: the
    second finds the folder the first completed and converts nothing."""
    import fcntl
    import threading

    import draftwise.loading.convert as convert

    folder = tmp_path / "converted" / "tiny-v3"
    folder.parent.mkdir()
    done = []
    with open(folder.with_name(f".{folder.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process converting
        waiter = threading.Thread(target=lambda: done.append(convert.convert_gguf(tiny_qwen_gguf, folder, progress=False)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not done  # it waits
        convert._convert(tiny_qwen_gguf, folder, progress=False)  # the other process finishes
        monkeypatch.setattr(convert, "_convert", lambda *args: pytest.fail("converted a second time"))
    waiter.join(30)
    assert done == [folder] and convert.is_converted(folder)


def test_gguf_tokenizer_equals_source_tokenizer(tiny_qwen, tiny_qwen_gguf, gguf_cache, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_CACHE", str(gguf_cache))
    original, converted = Tokenizer(tiny_qwen), Tokenizer(resolve_model(str(tiny_qwen_gguf), progress=False))
    for text in ["def add(a, b):\n    return a + b", "héllo wörld 你好 🙂", "<|im_start|>user\nhi<|im_end|>"]:
        assert converted.encode(text) == original.encode(text)
        assert converted.decode(converted.encode(text), skip_special_tokens=False) == text
    assert converted.eos_token_ids == original.eos_token_ids
    assert converted.chat_template == original.chat_template


def test_quantized_gguf_dequantizes_close_to_source(tiny_qwen, tmp_path, monkeypatch):
    from tests.tiny_models import write_tiny_gguf

    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tiny_qwen, tmp_path / "q8.gguf", quantize_q8=True)
    got, expected = logits(resolve_model(str(path), progress=False)), logits(tiny_qwen)
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="nope.gguf"):
        GGUFFile(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        GGUFFile(path)


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.01])
def test_truncated_gguf_is_a_clear_error(tiny_qwen_gguf, tmp_path, keep):
    data = tiny_qwen_gguf.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelFormatError, match="truncated.gguf.*(corrupt|truncated)"):
        GGUFFile(path)


def test_gguf_metadata_missing_or_zero_is_named(tiny_qwen, tmp_path, monkeypatch):
    import json
    import shutil
    from types import SimpleNamespace

    from draftwise.errors import ModelFormatError
    from draftwise.loading.gguf_file import GGUFFile
    from draftwise.loading.gguf_tokenizer import build_tokenizer
    from tests.tiny_models import write_tiny_gguf

    folder = tmp_path / "no-heads"
    shutil.copytree(tiny_qwen, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0, "num_key_value_heads": 0}))
    monkeypatch.setattr("draftwise.loading.hf_folder.read_config", lambda folder: SimpleNamespace(rope_theta=1e4))
    path = write_tiny_gguf(folder, tmp_path / "no-heads.gguf")  # (the writer reads one field through our config)
    monkeypatch.undo()
    with pytest.raises(ModelFormatError, match="no-heads.gguf: metadata qwen2.attention.head_count is 0"):
        GGUFFile(path)
    with pytest.raises(ModelFormatError, match="x.gguf: tokenizer metadata 'tokenizer.ggml.merges' is missing"):
        build_tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]}, "x.gguf")


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": "two"}, "config.json: num_hidden_layers must be an integer, got 'two'"),
    ({"max_position_embeddings": 0}, "config.json: max_position_embeddings must be a positive integer"),
    ({"hidden_size": None}, "config.json: hidden_size must be an integer, got None"),
    ({"rms_norm_eps": "small"}, "config.json: a malformed value"),
])
def test_malformed_config_values_are_named(tiny_qwen, change, message):
    import json

    from draftwise.errors import ModelFormatError
    from draftwise.model.config import ModelConfig

    config = {**json.loads((tiny_qwen / "config.json").read_text()), **change}
    with pytest.raises(ModelFormatError, match=message):
        ModelConfig.from_hf_dict(config)
    with pytest.raises(ModelFormatError, match="config.json: not a JSON object"):
        ModelConfig.from_hf_dict([config])


@pytest.mark.parametrize("metadata, message", [
    ({"split.count": 2, "split.no": 0}, "part 1 of a GGUF split into 2 files; merge them first"),
    ({"general.type": "adapter"}, "a LoRA adapter, not a model"),
])
def test_a_split_part_or_an_adapter_is_named_as_such(tiny_qwen, tmp_path, metadata, message):
    from tests.tiny_models import write_tiny_gguf

    path = write_tiny_gguf(tiny_qwen, tmp_path / "model.gguf", plain_metadata=metadata)
    with pytest.raises(ModelFormatError, match=message):
        GGUFFile(path)


def test_a_pre_quantized_checkpoint_is_refused_by_name(tiny_qwen):
    import json

    from draftwise.model.config import ModelConfig

    config = {**json.loads((tiny_qwen / "config.json").read_text()),
              "quantization_config": {"quant_method": "gptq", "bits": 4}}
    with pytest.raises(ModelFormatError, match="a pre-quantized checkpoint \\(gptq\\) is not supported"):
        ModelConfig.from_hf_dict(config)
