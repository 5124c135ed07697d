"""EAGLE heads on disk: vLLM's EAGLE-1 layout written and read back, speculators' EAGLE-1 format read,
what the head does not compute refused by name."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftwise.errors import InvalidParameterError, ModelFormatError
from draftwise.speculative.heads.eagle import EagleHead, EagleShape
from draftwise.speculative.heads.eagle_format import read_eagle, save_eagle

SHAPE = EagleShape(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                   rope_theta=10000.0, rms_norm_eps=1e-6, attention_bias=True)
VOCAB = 100
VLLM_NAMES = {"fc.weight", "layers.0.post_attention_layernorm.weight", "layers.0.self_attn.o_proj.weight",
              *(f"layers.0.self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")),
              *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}


def random_head(seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(SHAPE, torch.arange(10, 60))
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0, 0.2)
    return head.eval()


def outputs(head: EagleHead) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    features, embeddings = torch.randn(5, 32, generator=generator), torch.randn(5, 32, generator=generator)
    with torch.no_grad():
        return head(features, embeddings, torch.arange(5))


def test_round_trip_in_vllm_layout(tmp_path):
    head = random_head()
    save_eagle(tmp_path, head, VOCAB, {"target": "tiny"})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["intermediate_size"] == 48 and config["vocab_size"] == VOCAB
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert set(tensors) == VLLM_NAMES  # no input norm on layer 0, no final norm, no embedding or LM head
    assert tensors["fc.weight"].shape == (32, 64)
    loaded, _ = read_eagle(tmp_path, 32, VOCAB, lambda: pytest.fail("our heads keep their vocabulary"))
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    torch.testing.assert_close(outputs(loaded), outputs(head), rtol=0, atol=0)


def test_the_fc_reads_the_embedding_first(tmp_path):
    """vLLM and speculators feed fc with cat(embedding, feature): a head whose fc ignores the
    feature must ignore our `features` argument."""
    head = random_head()
    with torch.no_grad():
        head.fc.weight[:, 32:] = 0
    generator = torch.Generator().manual_seed(2)
    embeddings = torch.randn(3, 32, generator=generator)
    with torch.no_grad():
        a = head(torch.randn(3, 32, generator=generator), embeddings, torch.arange(3))
        b = head(torch.randn(3, 32, generator=generator), embeddings, torch.arange(3))
    torch.testing.assert_close(a, b)


def speculators_folder(tmp_path, head: EagleHead, **overrides):
    """`head` as speculators 0.3 writes an EAGLE-1 speculator."""
    save_eagle(tmp_path / "vllm", head, VOCAB, {})
    tensors = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    renamed = {("fusion_fc." + n.removeprefix("fc.")) if n.startswith("fc.") else
               ("transformer." + n.removeprefix("layers.0.")): t for n, t in tensors.items()}
    folder = tmp_path / "speculators"
    folder.mkdir()
    save_file(renamed, str(folder / "model.safetensors"))
    layer = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
             "attention_bias": True, "num_hidden_layers": 1, "vocab_size": VOCAB}
    config = {"architectures": ["EagleSpeculator"], "speculators_model_type": "eagle", "layernorms": False,
              "fusion_bias": False, "transformer_layer_architecture": "LlamaDecoderLayer",
              "transformer_layer_config": layer, "speculators_version": "0.3.0",
              "speculators_config": {"algorithm": "eagle", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "verifier": {"name_or_path": "tiny", "architectures": ["Qwen2ForCausalLM"]}},
              **overrides}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_speculators_eagle_format_is_read(tmp_path):
    head = random_head(3)
    folder = speculators_folder(tmp_path, head)
    kept = torch.arange(VOCAB)
    loaded, _ = read_eagle(folder, 32, VOCAB, lambda: kept)
    assert torch.equal(loaded.kept_ids, kept)  # a head from elsewhere scores the vocabulary it is given
    torch.testing.assert_close(outputs(loaded), outputs(head), rtol=0, atol=0)


@pytest.mark.parametrize("overrides, message", [
    ({"speculators_model_type": "eagle3"}, "an EAGLE-3 head"),
    ({"speculators_model_type": "mlp"}, "a speculators 'mlp' model, not an EAGLE head"),
    ({"layernorms": True}, "layernorms=true .* not supported"),
    ({"fusion_bias": True}, "fusion_bias=true .* not supported"),
])
def test_what_the_head_does_not_compute_is_refused_by_name(tmp_path, overrides, message):
    with pytest.raises(InvalidParameterError, match=message):
        read_eagle(speculators_folder(tmp_path, random_head(), **overrides), 32, VOCAB, lambda: torch.arange(VOCAB))


def test_a_head_whose_layer_scales_its_rotary_embedding_is_refused(tmp_path):
    folder = speculators_folder(tmp_path, random_head())
    config = json.loads((folder / "config.json").read_text())
    config["transformer_layer_config"]["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidParameterError, match="rope_scaling \\(yarn\\) is not supported"):
        read_eagle(folder, 32, VOCAB, lambda: torch.arange(VOCAB))


def test_a_head_for_another_target_or_a_torn_file_is_refused(tmp_path):
    save_eagle(tmp_path, random_head(), VOCAB, {})
    with pytest.raises(InvalidParameterError, match="made for hidden size 32 and 100 tokens; this target has 64"):
        read_eagle(tmp_path, 64, VOCAB, lambda: None)
    with pytest.raises(InvalidParameterError, match="this target has 32 and 200"):
        read_eagle(tmp_path, 32, 200, lambda: None)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["layers.0.mlp.down_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelFormatError, match="do not match its config"):
        read_eagle(tmp_path, 32, VOCAB, lambda: None)
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelFormatError, match="unreadable head"):
        read_eagle(tmp_path, 32, VOCAB, lambda: None)
    with pytest.raises(InvalidParameterError, match="not an EAGLE head folder"):
        read_eagle(tmp_path / "nowhere", 32, VOCAB, lambda: None)


def test_biases_come_from_the_file_and_tensors_it_does_not_compute_are_refused(tmp_path):
    """A Qwen2 layer config names no attention_bias: the q/k/v biases are read because the file has
    them. A tensor this head would ignore (fc.bias, an input norm) is refused, never dropped."""
    head = random_head(4)
    save_eagle(tmp_path, head, VOCAB, {})
    config = json.loads((tmp_path / "config.json").read_text())
    del config["attention_bias"]
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    loaded, _ = read_eagle(tmp_path, 32, VOCAB, lambda: None)
    torch.testing.assert_close(outputs(loaded), outputs(head), rtol=0, atol=0)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file({**tensors, "fc.bias": torch.zeros(32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(InvalidParameterError, match="does not compute: fc.bias"):
        read_eagle(tmp_path, 32, VOCAB, lambda: None)


def test_a_batched_step_computes_what_each_row_alone_computes():
    """Drafting steps run for all rows at once over caches of different lengths (padded, masked):
    each row's prediction is the one its own cached pass gives."""
    head = random_head(5)
    generator = torch.Generator().manual_seed(6)
    caches, alone = [], []
    with torch.no_grad():
        for length in (3, 7, 1):
            cache = head.new_cache()
            head(torch.randn(length, 32, generator=generator), torch.randn(length, 32, generator=generator),
                 torch.arange(length), cache)
            caches.append(cache)
        features, embeddings = torch.randn(3, 32, generator=generator), torch.randn(3, 32, generator=generator)
        positions = torch.tensor([3, 7, 1])
        for r, cache in enumerate(caches):
            copy = cache.prefix(cache.length)
            alone.append(head(features[r:r + 1], embeddings[r:r + 1], positions[r:r + 1], copy)[0])
        batched = head.step(features, embeddings, positions, caches)
    torch.testing.assert_close(batched, torch.stack(alone), rtol=1e-5, atol=1e-5)
    assert [cache.length for cache in caches] == [4, 8, 2]


def test_speculators_tensors_the_head_does_not_compute_are_refused_by_name(tmp_path):
    folder = speculators_folder(tmp_path, random_head(3))
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, "embedding_layernorm.weight": torch.ones(32)}, str(folder / "model.safetensors"))
    with pytest.raises(InvalidParameterError, match="does not compute: embedding_layernorm.weight"):
        read_eagle(folder, 32, VOCAB, lambda: torch.arange(VOCAB))


def test_a_head_whose_mlp_gate_is_not_silu_is_refused(tmp_path):
    save_eagle(tmp_path, random_head(), VOCAB, {})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(InvalidParameterError, match="hidden_act 'gelu' is not supported"):
        read_eagle(tmp_path, 32, VOCAB, lambda: torch.arange(VOCAB))
