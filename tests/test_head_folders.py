"""Where trained heads and distilled answers live, and what a user is told when a head is missing,
unfinished or damaged: a target is its folder (not its folder's name), an interrupted run is said to
be resumable, a checkpoint of another head is named, an unwritable --out is refused before the work."""

import json
import shutil

import pytest
import torch

from draftwise import LLM
from draftwise.errors import InvalidParameterError, ModelFormatError
from draftwise.speculative.heads.eagle3_format import read_eagle3
from draftwise.speculative.heads.eagle_format import read_eagle
from draftwise.speculative.heads.store import default_folder
from draftwise.speculative.heads.training import Checkpoint, TrainResult
from draftwise.training.train_head import train_head, weights_identity


def test_two_models_of_one_name_have_two_default_folders(tmp_path, monkeypatch):
    first, second = tmp_path / "a" / "model", tmp_path / "b" / "model"
    first.mkdir(parents=True)
    assert default_folder("medusa", str(first)) != default_folder("medusa", str(second))
    monkeypatch.chdir(first.parent)
    assert default_folder("medusa", "model") == default_folder("medusa", str(first))  # (relative: resolved)
    assert default_folder("medusa", ".").name != ""  # (before: the kind's own folder)
    assert default_folder("medusa", "qwen2.5-coder-1.5b").name == "qwen2.5-coder-1.5b"  # (known: by name)


def test_an_interrupted_run_is_said_to_be_resumable(tiny_qwen, tmp_path, monkeypatch):
    from tests.cache_env import own_cache_env

    monkeypatch.setenv("DRAFTWISE_CACHE", own_cache_env(tmp_path)["DRAFTWISE_CACHE"])  # (the built kernels kept)
    folder = default_folder("medusa", str(tiny_qwen))
    folder.mkdir(parents=True)
    (folder / "checkpoint.pt").write_bytes(b"")  # (a run stopped after an epoch: no config yet)
    with pytest.raises(InvalidParameterError, match="was not finished: its training was interrupted.*resumes it: "
                                                    "draftwise train-head --target"):
        LLM(str(tiny_qwen), max_model_len=64, progress=False, speculative={"method": "medusa"})


def test_a_checkpoint_of_another_head_is_named(tmp_path):
    path = tmp_path / "checkpoint.pt"
    wide, narrow = torch.nn.Linear(8, 4), torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(wide.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    Checkpoint(path, wide, optimizer, schedule).save(0, TrainResult({}))
    optimizer = torch.optim.SGD(narrow.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.raises(InvalidParameterError, match="checkpoint.pt: an interrupted run's checkpoint that this run "
                                                    "cannot resume .* delete it"):
        Checkpoint(path, narrow, optimizer, schedule).resume(TrainResult({}))
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(InvalidParameterError, match="cannot resume"):
        Checkpoint(path, narrow, optimizer, schedule).resume(TrainResult({}))


def test_an_unwritable_out_is_refused_before_the_target_loads(tiny_qwen, tmp_path):
    taken = tmp_path / "a-file"
    taken.write_text("x")
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    with pytest.raises(InvalidParameterError, match="--out .*a-file: exists and is not a folder"):
        train_head(str(tiny_qwen), "medusa", str(data), taken, progress=False)


def test_distilled_answers_are_keyed_by_the_weights(tiny_qwen, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_qwen, copy)
    assert weights_identity(copy) != weights_identity(tiny_qwen)  # (another folder: other answers)
    assert weights_identity(copy) == weights_identity(copy)
    weights = next(copy.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes() + b"")  # (rewritten: a new time)
    before = weights_identity(copy)
    weights.touch()
    import os
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert weights_identity(copy) != before


def test_malformed_head_configs_are_named(tmp_path):
    eagle = tmp_path / "eagle"
    eagle.mkdir()
    (eagle / "config.json").write_text(json.dumps({"draftwise": 5, "num_hidden_layers": 1}))
    (eagle / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelFormatError):
        read_eagle(eagle, 64, 320, lambda: torch.arange(320))
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.zeros(2, 2)}, str(eagle / "model.safetensors"))
    with pytest.raises(ModelFormatError, match="\"draftwise\" must be an object"):
        read_eagle(eagle, 64, 320, lambda: torch.arange(320))
    eagle3 = tmp_path / "eagle3"
    eagle3.mkdir()
    (eagle3 / "config.json").write_text(json.dumps({
        "speculators_model_type": "eagle3", "transformer_layer_config": {
            "vocab_size": None, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "rms_norm_eps": 1e-6, "head_dim": 16},
        "eagle_aux_hidden_state_layer_ids": [1, 1, 2]}))
    save_file({"midlayer.self_attn.q_proj.weight": torch.zeros(64, 128)}, str(eagle3 / "model.safetensors"))
    with pytest.raises((ModelFormatError, InvalidParameterError)):
        read_eagle3(eagle3, 64, 320, 2)
