"""Heads' training and files, checked where they went wrong: the held-out split never takes every
example nor picks the vocabulary, an EAGLE-1 run resumes to the uninterrupted run's weights (its
input noise seeded by epoch), and reading a head honours what its config says (the target's depth,
RoPE's theta where transformers 5 writes it, speculators' norm default) and only its own weights."""

import json

import pytest
import torch
from safetensors.torch import save_file

from draftwise.errors import InvalidParameterError
from draftwise.speculative.heads import eagle_training
from draftwise.speculative.heads.eagle import EagleHead, EagleShape
from draftwise.speculative.heads.eagle3 import Eagle3Head, Eagle3Shape
from draftwise.speculative.heads.eagle3_format import read_eagle3, save_eagle3
from draftwise.speculative.heads.eagle_format import read_eagle, save_eagle
from draftwise.speculative.heads.training import Example, TrainSettings, split_heldout, training_vocabulary
from draftwise.text.tokenizer import Tokenizer

SHAPE = EagleShape(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                   rope_theta=10000.0, rms_norm_eps=1e-6, attention_bias=False)


def synthetic(count: int, vocab: int = 50, hidden: int = 32) -> list[Example]:
    generator = torch.Generator().manual_seed(0)
    return [Example(torch.randint(0, vocab, (12,), generator=generator), 4, torch.randn(12, hidden, generator=generator))
            for _ in range(count)]


@pytest.mark.parametrize("count, share", [(2, 0.75), (10, 0.96)])
def test_the_held_out_split_always_leaves_examples_to_train_on(count, share):
    train, heldout = split_heldout(synthetic(count), TrainSettings(heldout_share=share))
    assert train and heldout and not {id(e) for e in train} & {id(e) for e in heldout}


def test_held_out_answers_do_not_choose_the_heads_vocabulary(tiny_qwen):
    tokenizer = Tokenizer(tiny_qwen)
    settings = TrainSettings(kept_tokens=20, heldout_share=0.5)
    examples = [Example(torch.tensor([1, 2, 3, 4, 5, 6]), 2, torch.zeros(6, 4)) for _ in range(3)]
    examples.append(Example(torch.tensor([1, 2, 300, 301, 302, 303]), 2, torch.zeros(6, 4)))
    train, heldout = split_heldout(examples, settings)
    rare = {300, 301, 302, 303}
    kept = set(training_vocabulary(examples, tokenizer, settings).tolist())
    trained_on = {int(t) for e in train for t in e.token_ids[e.answer_start:]}
    assert trained_on <= kept
    assert rare & kept == rare & trained_on  # (a rare token is kept only where a training answer holds it)


def test_an_eagle_run_resumed_after_an_interrupt_ends_with_the_uninterrupted_weights(tmp_path, monkeypatch):
    examples = synthetic(8)
    settings = TrainSettings(epochs=3, batch_size=16, heldout_share=0.0, learning_rate=1e-2)
    lm_rows = torch.randn(50, 32, generator=torch.Generator().manual_seed(2))
    embedding = torch.randn(50, 32, generator=torch.Generator().manual_seed(3))
    loss, calls = eagle_training.example_loss, []

    def trained(checkpoint, stop_after: int | None = None) -> dict:
        torch.manual_seed(0)
        head = EagleHead(SHAPE, torch.arange(50))

        def counted(*args, **kwargs):
            calls.append(1)
            if stop_after is not None and len(calls) > stop_after:
                raise KeyboardInterrupt
            return loss(*args, **kwargs)

        calls.clear()
        monkeypatch.setattr(eagle_training, "example_loss", counted)
        eagle_training.train_eagle(head, lm_rows, lambda ids: embedding[ids], examples, 50, settings, checkpoint,
                                   progress=False)
        return {name: t.detach().clone() for name, t in head.state_dict().items()}

    whole = trained(tmp_path / "whole.pt")
    with pytest.raises(KeyboardInterrupt):
        trained(tmp_path / "resumed.pt", stop_after=8 + 3)  # (in the second epoch)
    resumed = trained(tmp_path / "resumed.pt")
    for name in whole:
        torch.testing.assert_close(resumed[name], whole[name], rtol=0, atol=0, msg=name)


def eagle_folder(tmp_path) -> tuple:
    torch.manual_seed(0)
    head = EagleHead(SHAPE, torch.arange(10, 60)).eval()
    save_eagle(tmp_path, head, 100, {"target": "tiny"})
    return tmp_path, head


def test_eagle_reads_rope_theta_where_transformers_5_writes_it(tmp_path):
    folder, _ = eagle_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_theta", None)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    (folder / "config.json").write_text(json.dumps(config))
    loaded, _ = read_eagle(folder, 32, 100, lambda: torch.arange(100))
    assert loaded.shape.rope_theta == 1e6


def test_another_heads_weights_left_in_the_folder_are_not_read(tmp_path):
    folder, head = eagle_folder(tmp_path)
    save_file({"heads.0.linear.bias": torch.zeros(4)}, str(folder / "head.safetensors"))  # (a Medusa head's)
    loaded, _ = read_eagle(folder, 32, 100, lambda: torch.arange(100))
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))


def eagle3_folder(tmp_path, draftwise: dict) -> Eagle3Head:
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Shape(32, 4, 2, 8, 48, 10000.0, 1e-6), torch.arange(50)).eval()
    save_eagle3(tmp_path, head, 50, (2, 4, 5), "tiny", draftwise)
    return head


def test_an_eagle3_head_made_for_a_target_of_another_depth_is_refused(tmp_path):
    eagle3_folder(tmp_path, {"kind": "eagle3", "target_layers": 8})
    read_eagle3(tmp_path, 32, 50, 8)
    with pytest.raises(InvalidParameterError, match="made for a target of 8 layers; this target has 6"):
        read_eagle3(tmp_path, 32, 50, 6)


def test_a_speculators_config_without_norm_before_residual_means_it_is_on(tmp_path):
    """vLLM reads speculators' EAGLE-3 configs so (`norm_before_residual` defaults to true there)."""
    eagle3_folder(tmp_path, {"kind": "eagle3"})
    config = json.loads((tmp_path / "config.json").read_text())
    assert "speculators_model_type" in config
    config.pop("norm_before_residual")
    (tmp_path / "config.json").write_text(json.dumps(config))
    head, _, _ = read_eagle3(tmp_path, 32, 50, 8)
    assert head.shape.norm_before_residual is True


def test_an_eagle3_config_whose_draft_vocabulary_disagrees_with_its_lm_head_is_refused(tmp_path):
    from draftwise.errors import ModelFormatError

    eagle3_folder(tmp_path, {"kind": "eagle3"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "draft_vocab_size": 7}))
    with pytest.raises(ModelFormatError, match="draft_vocab_size 7, but lm_head.weight scores 50 tokens"):
        read_eagle3(tmp_path, 32, 50, 8)
