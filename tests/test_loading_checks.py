"""What the loaders refuse rather than load wrong: weight shards that disagree with each other or with
their index, config.json fields that would change the computation unnoticed, and a dummy load of a GGUF
file that needs only its metadata."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftwise.errors import ModelFormatError
from draftwise.loading import gguf_file
from draftwise.loading.hf_folder import load_model, read_config
from draftwise.loading.resolve import resolve_model
from draftwise.model.config import ModelConfig
from draftwise.text.tokenizer import Tokenizer
from tests.tiny_models import write_tiny_gguf

INDEX = "model.safetensors.index.json"
FIRST, SECOND = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def sharded_copy(source: Path, folder: Path, index: bool = True) -> Path:
    """The tiny model's folder with its weights split in two files (the embedding alone in the first),
    and the index transformers writes for them."""
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(source / "model.safetensors"))
    first = {name: tensor for name, tensor in tensors.items() if "embed_tokens" in name}
    second = {name: tensor for name, tensor in tensors.items() if name not in first}
    save_file(first, str(folder / FIRST))
    save_file(second, str(folder / SECOND))
    if index:
        weight_map = {**{name: FIRST for name in first}, **{name: SECOND for name in second}}
        (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def load(folder: Path):
    return load_model(folder, quantization="none", pack_cpu_weights=False)


def edit_index(folder: Path, edit) -> None:
    index = json.loads((folder / INDEX).read_text())
    edit(index["weight_map"])
    (folder / INDEX).write_text(json.dumps(index))


# --- shards and their index ---------------------------------------------------------------------------

def test_indexed_shards_load_and_a_stale_shard_beside_them_is_not_read(tiny_qwen, tmp_path):
    folder = sharded_copy(tiny_qwen, tmp_path / "sharded")
    original = load_file(str(tiny_qwen / "model.safetensors"))["model.embed_tokens.weight"]
    save_file({"model.embed_tokens.weight": torch.zeros_like(original)}, str(folder / "stale.safetensors"))
    model = load(folder)
    assert torch.equal(model.embed_tokens.weight, original)


def test_a_weight_file_the_index_names_that_is_missing_is_named(tiny_qwen, tmp_path):
    folder = sharded_copy(tiny_qwen, tmp_path / "sharded")
    (folder / SECOND).unlink()
    with pytest.raises(ModelFormatError, match=f"{INDEX}: names weight file {SECOND}, which is missing"):
        load(folder)


def test_a_tensor_in_another_file_than_the_index_says_is_refused(tiny_qwen, tmp_path):
    folder = sharded_copy(tiny_qwen, tmp_path / "sharded")
    edit_index(folder, lambda weight_map: weight_map.update({"model.norm.weight": FIRST}))
    with pytest.raises(ModelFormatError, match=f"puts tensor 'model.norm.weight' in {FIRST}, but {SECOND} holds it"):
        load(folder)


def test_a_tensor_the_index_lists_that_no_file_holds_is_refused(tiny_qwen, tmp_path):
    folder = sharded_copy(tiny_qwen, tmp_path / "sharded")
    edit_index(folder, lambda weight_map: weight_map.update({"model.extra.weight": FIRST}))
    with pytest.raises(ModelFormatError, match=f"puts tensor 'model.extra.weight' in {FIRST}, which does not hold"):
        load(folder)


def test_without_an_index_one_tensor_in_two_files_is_refused(tiny_qwen, tmp_path):
    folder = sharded_copy(tiny_qwen, tmp_path / "sharded", index=False)
    assert load(folder).config.num_hidden_layers == 2  # (two shards without an index are fine)
    embedding = load_file(str(folder / FIRST))["model.embed_tokens.weight"]
    save_file({"model.embed_tokens.weight": embedding}, str(folder / "stale.safetensors"))
    with pytest.raises(ModelFormatError, match=f"'model.embed_tokens.weight' is in two weight files, {FIRST} "
                                               "and stale.safetensors"):
        load(folder)


# --- config.json fields that change the computation -------------------------------------------------------

def config_with(tiny_qwen: Path, folder: Path, **fields) -> Path:
    folder.mkdir()
    config = {**json.loads((tiny_qwen / "config.json").read_text()), **fields}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("name, ours", [("silu", "silu"), ("swish", "silu"), ("gelu_pytorch_tanh", "gelu_tanh")])
def test_activations_the_mlp_computes_are_read(tiny_qwen, tmp_path, name, ours):
    assert read_config(config_with(tiny_qwen, tmp_path / "model", hidden_act=name)).hidden_act == ours


@pytest.mark.parametrize("name", ["gelu", "relu", "gelu_new"])
def test_other_activations_are_refused_by_field_and_value(tiny_qwen, tmp_path, name):
    folder = config_with(tiny_qwen, tmp_path / "model", hidden_act=name)
    with pytest.raises(ModelFormatError, match=f"config.json: hidden_act '{name}' is not supported"):
        read_config(folder)


def test_the_activation_survives_a_round_trip_through_config_json(tiny_qwen, tmp_path):
    config = read_config(config_with(tiny_qwen, tmp_path / "model", hidden_act="gelu_pytorch_tanh"))
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


@pytest.mark.parametrize("fields, where", [
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e4, "partial_rotary_factor": 0.25}},
     "rope_parameters.partial_rotary_factor"),
])
def test_partial_rotary_embeddings_are_refused_by_name(tiny_qwen, tmp_path, fields, where):
    folder = config_with(tiny_qwen, tmp_path / "model", **fields)
    with pytest.raises(ModelFormatError, match=f"config.json: {where} .* is not supported"):
        read_config(folder)


def test_a_partial_rotary_factor_of_one_rotates_everything_and_is_read(tiny_qwen, tmp_path):
    assert read_config(config_with(tiny_qwen, tmp_path / "model", partial_rotary_factor=1.0)).head_dim == 16


def test_a_gguf_rotating_part_of_each_head_is_refused(tiny_qwen, tmp_path):
    path = write_tiny_gguf(tiny_qwen, tmp_path / "partial.gguf", metadata={"rope.dimension_count": 8})
    with pytest.raises(ModelFormatError, match="qwen2.rope.dimension_count 8 is not the head size 16"):
        gguf_file.GGUFFile(path)


# --- a dummy load of a GGUF file ----------------------------------------------------------------------

def test_a_dummy_load_of_a_gguf_reads_its_metadata_not_its_tensors(tiny_qwen, tiny_qwen_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))

    def no_tensors(self):
        raise AssertionError("a dummy load dequantized the GGUF's tensors")

    monkeypatch.setattr(gguf_file.GGUFFile, "tensors", no_tensors)
    folder = resolve_model(str(tiny_qwen_gguf), progress=False, load_format="dummy")
    assert not list(folder.glob("*.safetensors"))
    model = load_model(folder, quantization="none", load_format="dummy")
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads")
    assert [getattr(model.config, name) for name in shape] == [getattr(read_config(tiny_qwen), name) for name in shape]
    assert Tokenizer(folder).encode("def add(a, b):") == Tokenizer(tiny_qwen).encode("def add(a, b):")
    monkeypatch.undo()  # (a real load afterwards converts the weights, into a folder of its own)
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    converted = resolve_model(str(tiny_qwen_gguf), progress=False)
    assert converted != folder and list(converted.glob("*.safetensors"))
    assert resolve_model(str(tiny_qwen_gguf), progress=False, load_format="dummy") == converted


# --- a config that disagrees with the weights: refused before a model of its size is built ------------

def copy_with(tiny_qwen: Path, folder: Path, **fields) -> Path:
    shutil.copytree(tiny_qwen, folder)
    config = {**json.loads((tiny_qwen / "config.json").read_text()), **fields}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("fields, message", [
    ({"num_hidden_layers": 1_000_000_000}, "num_hidden_layers is 1000000000: past any model's"),  # (hung, growing)
    ({"hidden_size": 1 << 40, "head_dim": 16}, "hidden_size is 1099511627776: past any model's"),  # (a traceback)
    ({"head_dim": 1 << 40}, "head_dim is 1099511627776: past any model's"),  # (tried to allocate 4 TB)
    ({"num_hidden_layers": 3}, "num_hidden_layers is 3, the weights hold 2 layers"),
    ({"intermediate_size": 96}, r"mlp.gate_proj.weight is \[\d+, \d+\], the config makes it \[96, \d+\]"),
])
def test_a_config_the_weights_cannot_fill_is_refused_by_name(tiny_qwen, tmp_path, fields, message):
    assert json.loads((tiny_qwen / "config.json").read_text())["num_hidden_layers"] == 2
    with pytest.raises(ModelFormatError, match=message):
        load(copy_with(tiny_qwen, tmp_path / "model", **fields))


def test_a_projection_narrower_than_its_neighbours_is_named_not_a_concatenation_error(tiny_qwen, tmp_path):
    folder = copy_with(tiny_qwen, tmp_path / "model")
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name][:, :16].contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelFormatError, match=r"layers.0.self_attn.q_proj.weight is \[\d+, 16\], the config"):
        load(folder)


@pytest.mark.parametrize("tokens, merges, message", [
    (["a", "b", "c"], ["\u0120 a"], "inconsistent tokenizer metadata .*out of vocabulary"),  # (a bare Exception)
    (["a", "a", "b"], [], "1 duplicate tokens"),
])
def test_a_gguf_vocabulary_its_merges_do_not_fit_is_refused_by_name(tokens, merges, message):
    from draftwise.loading.gguf_tokenizer import build_tokenizer

    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges}
    with pytest.raises(ModelFormatError, match=message):
        build_tokenizer(metadata, "damaged.gguf")


@pytest.mark.parametrize("damage, message", [("misaligned", "off the file's 32-byte alignment"),
                                             ("overlapping", "overlap")])
def test_a_gguf_tensor_offset_off_its_alignment_or_onto_another_is_refused(tiny_qwen, tmp_path, damage, message):
    import gguf

    path = write_tiny_gguf(tiny_qwen, tmp_path / "damaged.gguf")
    reader = gguf.GGUFReader(str(path), "r+")
    first, second = reader.tensors[0], reader.tensors[1]
    offset = second.field.parts[-1]  # (the tensor's offset in the data section, in place in the file)
    offset[0] = first.field.parts[-1][0] + (1 if damage == "misaligned" else 32)
    reader.data.flush()
    del reader
    with pytest.raises(ModelFormatError, match=message):
        gguf_file.GGUFFile(path)


@pytest.mark.parametrize("fields, message", [
    ({"hidden_size": 64.5}, "hidden_size must be an integer, got 64.5"),  # (was cut to 64)
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be a positive number"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a positive number"),
])
def test_config_values_no_model_has_are_refused_by_name(tiny_qwen, tmp_path, fields, message):
    with pytest.raises(ModelFormatError, match=message):
        read_config(config_with(tiny_qwen, tmp_path / "model", **fields))


def test_a_size_written_as_a_whole_float_is_read(tiny_qwen, tmp_path):
    hidden = json.loads((tiny_qwen / "config.json").read_text())["hidden_size"]
    assert read_config(config_with(tiny_qwen, tmp_path / "model", hidden_size=float(hidden))).hidden_size == hidden
