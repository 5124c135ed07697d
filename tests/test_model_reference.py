"""Our forward pass against Hugging Face transformers on the same weights."""

import pytest
import torch

from draftwise.loading.hf_folder import load_model
from draftwise.runner.model_runner import ModelRunner

PROMPT = [[5, 17, 42, 99, 3, 250, 7, 8, 120, 33]]


def reference_logits(folder, token_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(token_ids)).logits


@pytest.mark.parametrize("fixture", ["tiny_qwen", "tiny_llama"])
@pytest.mark.parametrize("packed", [True, False])
def test_logits_match_transformers(request, fixture, packed):
    folder = request.getfixturevalue(fixture)
    expected = reference_logits(folder, PROMPT)
    model = load_model(folder, pack_cpu_weights=packed)
    tokens = torch.tensor(PROMPT)
    positions = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        got = model(tokens, positions)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_incremental_decoding_matches_full_pass(tiny_qwen):
    """Prefill then one token at a time through the cache gives the full pass's logits."""
    expected = reference_logits(tiny_qwen, PROMPT)[0]
    runner = ModelRunner(load_model(tiny_qwen), max_num_rows=1, max_len=64, block_size=4)
    row = runner.allocate()
    tokens = PROMPT[0]
    first = runner.forward([row], [tokens[:4]], [4]).logits
    steps = [runner.forward([row], [[t]], [1]).logits[0] for t in tokens[4:]]
    got = torch.cat([first, torch.stack(steps)])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_first_layers_and_hidden_states(tiny_qwen):
    """num_layers=L equals a model truncated to L layers; captured states are the residual stream."""
    model = load_model(tiny_qwen, pack_cpu_weights=False)
    tokens = torch.tensor(PROMPT)
    positions = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        hidden_1, captured = model.hidden_states(tokens, positions, num_layers=1, capture_layers=(0,))
        full, captured_all = model.hidden_states(tokens, positions, capture_layers=(0, 1))
    torch.testing.assert_close(hidden_1, captured[0])
    torch.testing.assert_close(captured_all[0], hidden_1)
    torch.testing.assert_close(captured_all[1], full)
    assert not torch.allclose(hidden_1, full)


def test_mistrals_sliding_window_is_honoured_as_transformers_does(tiny_llama, tmp_path):
    """A Mistral config.json with sliding_window (7B v0.1: 4096) attends over that many keys in every
    layer (it was ignored: the output of a window-less model); decoding through the cache agrees."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    folder = tmp_path / "tiny-mistral"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4)
    (folder / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    with torch.no_grad():
        expected = reference(torch.tensor(PROMPT)).logits[0]  # [10, V]
    model = load_model(folder)
    assert model.config.sliding_window == 4
    runner = ModelRunner(model, max_num_rows=1, max_len=64, block_size=4)
    row = runner.allocate()
    first = runner.forward([row], [PROMPT[0][:6]], [6]).logits
    steps = [runner.forward([row], [[t]], [1]).logits[0] for t in PROMPT[0][6:]]
    torch.testing.assert_close(torch.cat([first, torch.stack(steps)]), expected, rtol=1e-4, atol=1e-4)
