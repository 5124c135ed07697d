"""EAGLE-3 heads: trained here with training-time test on the tiny model's own answers, lossless as a
drafter, fed three of the target's layers at every committed position, read and written in
speculators' format, refused by name where they compute what draftwise does not."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftwise import LLM, SamplingParams
from draftwise.errors import InvalidParameterError, ModelFormatError
from draftwise.speculative.heads.eagle3 import Eagle3Head, Eagle3Shape
from draftwise.speculative.heads.eagle3_format import default_aux_layers, read_eagle3, save_eagle3
from draftwise.speculative.heads.training import TrainSettings
from draftwise.training.distill import hidden_states
from draftwise.training.train_head import train_head
from tests.cache_env import own_cache_env
from tests.drafting import assert_constrained_equal, assert_drafted
from tests.test_eagle import TRAINING_PROMPTS
from tests.test_spec_equality import PROMPTS, CyclingLength
from tests.test_speculative_sampling import SENTENCE, copying_target, failed_positions  # noqa: F401 (a fixture)

GREEDY = SamplingParams(temperature=0, max_tokens=24)
SETTINGS = TrainSettings(num_heads=3, epochs=40, batch_size=32, learning_rate=1e-2, heldout_share=0.0,
                         kept_tokens=256, head_width=64)


@pytest.fixture(scope="module")
def trained_head(tiny_qwen, tmp_path_factory):
    """A head trained on the prompts the tests then run (memorised: the tests need acceptance)."""
    data = tmp_path_factory.mktemp("eagle3-data") / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in TRAINING_PROMPTS))
    return train_head(str(tiny_qwen), "eagle3", str(data), tmp_path_factory.mktemp("head3"), settings=SETTINGS,
                      sample=len(TRAINING_PROMPTS), max_tokens=32, progress=False)


@pytest.fixture(scope="module")
def plain(tiny_qwen):
    return LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False)


def eagle3(tiny_qwen, folder, **spec):
    return LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False,
               speculative={"method": "eagle3", "head": str(folder), **spec})


def _config(tiny_qwen) -> dict:
    return json.loads((tiny_qwen / "config.json").read_text())


def test_training_learns_to_draft_chains_and_writes_speculators_format(trained_head, tiny_qwen):
    folder, result = trained_head
    first, last = result.reports[0], result.reports[-1]
    assert last.train_loss < first.train_loss
    assert last.heldout_acceptance[0] > 0.5 and last.heldout_acceptance[2] > 0.2  # (memorised)
    assert (folder / "model.safetensors").is_file() and not (folder / "checkpoint.pt").exists()
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draftwise"]["kind"] == "eagle3"
    assert config["transformer_layer_config"]["intermediate_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == list(default_aux_layers(2)) == [1, 1, 2]
    tensors = load_file(str(folder / "model.safetensors"))
    kept = tensors["d2t"] + torch.arange(len(tensors["d2t"]))  # speculators' offsets back to target ids
    assert tensors["t2d"].sum() == len(kept) == config["draft_vocab_size"] == tensors["lm_head.weight"].shape[0]
    assert bool(tensors["t2d"][kept].all()) and tensors["fc.weight"].shape == (64, 3 * 64)


@pytest.mark.parametrize("branches", [1, 3])
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equality_alone_and_batched(trained_head, tiny_qwen, plain, k, adaptive, branches, drafting_pays):
    llm = eagle3(tiny_qwen, trained_head[0], num_speculative_tokens=k, adaptive=adaptive, eagle3_branches=branches)
    expected = [o.token_ids for o in plain.generate(TRAINING_PROMPTS, GREEDY)]
    solo = [llm.generate(p, GREEDY)[0] for p in TRAINING_PROMPTS]
    batched = llm.generate(TRAINING_PROMPTS, GREEDY)
    assert [o.token_ids for o in solo] == expected and [o.token_ids for o in batched] == expected
    assert_drafted(solo) and assert_drafted(batched)
    if branches > 1 and not adaptive:  # leaves were verified beside the chain
        assert llm.spec_metrics.num_draft_tokens > llm.spec_metrics.num_drafts * k


def test_the_head_reads_three_target_layers_at_every_committed_position(trained_head, tiny_qwen):
    """What the engine hands the head over a request (prefill, verifications with rejections, plain
    steps) is, layer by layer, the teacher-forced pass's residual streams at positions 0..N-2."""
    llm = eagle3(tiny_qwen, trained_head[0], num_speculative_tokens=3, adaptive=False)
    llm.engine.drafters["eagle3"].draft_length = CyclingLength([3, 0, 2, 3, 1])
    proposer = llm.engine.drafters["eagle3"].proposer
    assert proposer.hidden_layers == (0, 0, 1)  # speculators' ids 1, 1, 2: the streams entering those layers
    handed: list[torch.Tensor] = []
    original = proposer.on_hidden

    def spy(seqs, hidden):
        handed.extend(torch.cat([hidden[layer][b] for layer in proposer.hidden_layers], dim=-1)
                      for b in range(len(seqs)))
        original(seqs, hidden)

    proposer.on_hidden = spy
    out = llm.generate(TRAINING_PROMPTS[1], SamplingParams(temperature=0, max_tokens=80))[0]
    assert 0 < llm.spec_metrics.num_accepted_tokens < llm.spec_metrics.num_draft_tokens
    tokens = list(out.prompt_token_ids) + list(out.token_ids)
    states = torch.cat(handed)  # [N-1, 3H]
    expected = hidden_states(llm, tokens, proposer.hidden_layers)[1][:-1].float()
    assert states.shape == expected.shape
    error = (states - expected).abs().max()  # (bfloat16 in the teacher-forced copy)
    assert error < 0.05 * expected.abs().max(), (error, expected.abs().max())
    assert (states[1:] - expected[:-1]).abs().max() > 0.2 * expected.abs().max()


def test_training_time_test_computes_what_drafting_computes():
    """`unrolled` step j at row t (the head's own feature, attending the true context and its own
    earlier steps) equals drafting from t with the head's cache, fed the same tokens."""
    torch.manual_seed(0)
    shape = Eagle3Shape(32, 4, 2, 8, 48, 10000.0, 1e-6)
    head = Eagle3Head(shape, torch.arange(50)).eval()
    seq = 9
    aux, embeddings = torch.randn(seq, 96), torch.randn(seq + 3, 32)
    positions = torch.arange(seq)
    with torch.no_grad():
        features = head.fuse(aux)
        earlier, unrolled = [], []
        step_features = features
        for j in range(3):
            step_features, kv = head.unrolled(step_features, embeddings[j:j + seq], positions + j, earlier)
            earlier.append(kv)
            unrolled.append(step_features)
        for t in (0, 4, seq - 1):
            cache = head.new_cache()
            drafted = head(features[:t + 1], embeddings[:t + 1], positions[:t + 1], cache)[-1]
            assert torch.allclose(drafted, unrolled[0][t], atol=1e-5)
            for j in (1, 2):
                drafted = head(drafted[None], embeddings[t + j:t + j + 1], torch.tensor([t + j]), cache)[0]
                assert torch.allclose(drafted, unrolled[j][t], atol=1e-5), (t, j)


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_inside_an_accepted_run(trained_head, tiny_qwen, plain, max_tokens):
    llm = eagle3(tiny_qwen, trained_head[0], num_speculative_tokens=4, adaptive=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(TRAINING_PROMPTS, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(TRAINING_PROMPTS, params)]
    assert all(len(o.token_ids) == max_tokens for o in outputs)


@pytest.mark.parametrize("eos_index", [2, 4])
def test_eos_inside_an_accepted_run(trained_head, tiny_qwen, plain, monkeypatch, eos_index):
    llm = eagle3(tiny_qwen, trained_head[0], num_speculative_tokens=4, adaptive=False)
    prompt = TRAINING_PROMPTS[0]
    full = plain.generate(prompt, GREEDY)[0].token_ids
    eos = full[eos_index]
    for target in (llm, plain):
        monkeypatch.setattr(target.tokenizer, "eos_token_ids", frozenset({eos}))
    out = llm.generate(prompt, GREEDY)[0]
    assert out.token_ids == full[:full.index(eos) + 1] and out.finish_reason == "stop"
    assert llm.spec_metrics.num_accepted_tokens > 0


def test_an_untrained_head_is_accepted_less(trained_head, tiny_qwen, tmp_path):
    config = _config(tiny_qwen)
    trained, aux, _ = read_eagle3(trained_head[0], 64, config["vocab_size"], 2)
    torch.manual_seed(0)
    save_eagle3(tmp_path, Eagle3Head(trained.shape, trained.kept_ids), config["vocab_size"], aux, "tiny",
                {"kind": "eagle3"})
    rates = []
    for folder in (trained_head[0], tmp_path):
        llm = eagle3(tiny_qwen, folder, num_speculative_tokens=3, adaptive=False)
        llm.generate(TRAINING_PROMPTS, GREEDY)
        rates.append(llm.spec_metrics.acceptance_rate)
    assert rates[0] > rates[1] + 0.2, rates


def test_a_round_trip_through_speculators_format_keeps_every_tensor(trained_head, tiny_qwen, tmp_path):
    config = _config(tiny_qwen)
    head, aux, _ = read_eagle3(trained_head[0], 64, config["vocab_size"], 2)
    save_eagle3(tmp_path, head, config["vocab_size"], aux, "tiny", {"kind": "eagle3"})
    again, aux_again, _ = read_eagle3(tmp_path, 64, config["vocab_size"], 2)
    assert aux_again == aux
    for (name, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_the_eagle3_repository_layout_serves_the_same(trained_head, tiny_qwen, plain, tmp_path):
    """The EAGLE-3 repository's layout (a Llama config with draft_vocab_size, `midlayer.*`, no
    verifier block) reads as the same head and drafts the same."""
    config = json.loads((trained_head[0] / "config.json").read_text())
    tensors = load_file(str(trained_head[0] / "model.safetensors"))
    save_file({("midlayer." + n.removeprefix("layers.0.")) if n.startswith("layers.0.") else n: t
               for n, t in tensors.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        **config["transformer_layer_config"], "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": config["draft_vocab_size"],
        "eagle_aux_hidden_state_layer_ids": config["eagle_aux_hidden_state_layer_ids"]}))
    llm = eagle3(tiny_qwen, tmp_path, num_speculative_tokens=3, adaptive=False)
    outputs = llm.generate(TRAINING_PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(TRAINING_PROMPTS, GREEDY)]
    assert llm.spec_metrics.acceptance_rate > 0.5


def _rewritten(trained_head, tmp_path, config_change=None, tensor_change=None):
    config = json.loads((trained_head[0] / "config.json").read_text())
    tensors = load_file(str(trained_head[0] / "model.safetensors"))
    if config_change:
        config_change(config)
    if tensor_change:
        tensor_change(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _layer(config: dict) -> dict:
    return config["transformer_layer_config"]


@pytest.mark.parametrize("config_change, tensor_change, message", [
    (lambda c: c.update(norm_before_fc=True), None, "norm_before_fc=true is not supported"),
    (lambda c: c.update(fc_norm=True), None, "fc_norm=true is not supported"),
    (lambda c: _layer(c).update(num_hidden_layers=2), None, "of 2 layers"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 9]), None, "do not fit a target of 2 layers"),
    (lambda c: c.update(speculators_model_type="eagle"), None, "a speculators 'eagle' model, not an EAGLE-3 head"),
    (lambda c: _layer(c).update(hidden_size=128), None, "made for hidden size 128"),
    (None, lambda t: t.update({"layers.0.self_attn.q_norm.weight": torch.ones(8)}), "does not compute: .*q_norm"),
    (lambda c: _layer(c).update(rope_scaling={"rope_type": "llama3", "factor": 8.0}), None, "rope_scaling \\(llama3\\)"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids="2,14,25"), None, "do not fit"),
])
def test_what_the_head_does_not_compute_is_refused_by_name(trained_head, tiny_qwen, tmp_path, config_change,
                                                           tensor_change, message):
    folder = _rewritten(trained_head, tmp_path, config_change, tensor_change)
    with pytest.raises(InvalidParameterError, match=message):
        eagle3(tiny_qwen, folder)


def test_pickled_weights_are_refused_by_name(trained_head, tiny_qwen, tmp_path):
    folder = _rewritten(trained_head, tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(InvalidParameterError, match="safetensors only"):
        eagle3(tiny_qwen, folder)


def test_a_broken_vocabulary_map_is_a_format_error(trained_head, tiny_qwen, tmp_path):
    # every draft id onto target id 0
    folder = _rewritten(trained_head, tmp_path, tensor_change=lambda t: t.update(d2t=-torch.arange(len(t["d2t"]))))
    with pytest.raises(ModelFormatError, match="d2t does not map"):
        eagle3(tiny_qwen, folder)


def test_heads_of_one_kind_are_not_served_as_the_other(trained_head, tiny_qwen, tmp_path, monkeypatch):
    with pytest.raises(InvalidParameterError, match="serve it with the EAGLE-3 drafter"):
        LLM(str(tiny_qwen), max_model_len=64, progress=False,
            speculative={"method": "eagle", "head": str(trained_head[0])})
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path))
    with pytest.raises(InvalidParameterError, match="draftwise train-head --target .* --kind eagle3"):
        LLM(str(tiny_qwen), max_model_len=64, progress=False, speculative={"method": "eagle3"})


def test_the_command_trains_an_eagle3_head(tiny_qwen, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    result = subprocess.run([sys.executable, "-m", "draftwise", "train-head", "--target", str(tiny_qwen), "--kind",
                             "eagle3", "--data", str(data), "--out", str(tmp_path / "head"), "--epochs", "1",
                             "--max-tokens", "8", "--kept-tokens", "64", "--head-width", "32"],
                            capture_output=True, text=True, timeout=300,
                            env=own_cache_env(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    assert "held-out acceptance by position" in result.stdout
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["transformer_layer_config"]["intermediate_size"] == 32


def test_sampling_with_eagle3_drafts_follows_the_target(copying_target, tmp_path):
    """Deterministic drafts verified by rejection sampling: every position's tokens follow the
    target's warped distribution (chi-square, as for the other drafters)."""
    prompt = " ".join([SENTENCE] * 8)
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": prompt}) + "\n" + json.dumps({"prompt": " ".join([SENTENCE] * 5)}) + "\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        folder, _ = train_head(str(copying_target), "eagle3", str(data), tmp_path / "head", progress=False,
                               settings=TrainSettings(num_heads=3, epochs=20, batch_size=16, learning_rate=1e-2,
                                                      heldout_share=0.0, kept_tokens=256, head_width=32),
                               sample=2, max_tokens=24)
        llm = LLM(str(copying_target), max_model_len=128, max_num_seqs=16, progress=False,
                  speculative={"method": "eagle3", "head": str(folder), "num_speculative_tokens": 3,
                               "adaptive": False})
        assert not failed_positions(llm, prompt)
        assert llm.spec_metrics.num_accepted_tokens > 0
    finally:
        torch.set_num_threads(threads)


def test_seeded_sampling_with_trees_equals_plain_seeded_sampling(trained_head, tiny_qwen, plain):
    """Trees are drafted for seeded rows (unseeded ones draft chains): each token is verified against
    the target's own seeded draw, so the output is plain decoding's, token for token, whatever the tree."""
    llm = eagle3(tiny_qwen, trained_head[0], num_speculative_tokens=3, adaptive=False, eagle3_branches=3)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=24) for seed in range(6)]
    prompts = [TRAINING_PROMPTS[i % len(TRAINING_PROMPTS)] for i in range(6)]
    expected = [plain.generate(prompt, p)[0].token_ids for prompt, p in zip(prompts, params)]
    assert _together(llm, prompts, params) == expected
    # Trees were drafted and verified at every step (more nodes than a chain of 3). Acceptance is not
    # asked: at temperature 0.9 the random target's draws are nearly flat over its vocabulary, and a
    # tree matched them 0 and 2 times in ~2,000 nodes in two runs (the head's training is not
    # bit-reproducible); the greedy tree tests above ask for acceptance.
    assert llm.spec_metrics.num_draft_tokens > llm.spec_metrics.num_drafts * 3


def _together(llm, prompts, params) -> list[list[int]]:
    """Every request added at once (one batch), outputs in prompt order."""
    ids = [llm.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    done = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                done[output.request_id] = output.token_ids
    return [done[i] for i in ids]


def test_structured_outputs_equal_plain_constrained_decoding(trained_head, tiny_qwen, plain, drafting_pays):
    llm = eagle3(tiny_qwen, trained_head[0], num_speculative_tokens=3)
    assert_constrained_equal(llm, plain, TRAINING_PROMPTS)
