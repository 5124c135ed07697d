"""EAGLE heads: trained here on the tiny model's own answers, lossless as a drafter, fed the target's
features at every committed position, stored and refused by name."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftwise import LLM, SamplingParams
from draftwise.errors import InvalidParameterError
from draftwise.speculative.heads.eagle import EagleHead
from draftwise.speculative.heads.eagle_format import read_eagle, save_eagle
from draftwise.speculative.heads.head_proposer import TREE_NODES
from draftwise.speculative.heads.training import TrainSettings
from draftwise.training.distill import hidden_states
from draftwise.training.train_head import train_head
from tests.cache_env import own_cache_env
from tests.drafting import assert_constrained_equal, assert_drafted
from tests.test_spec_equality import PROMPTS, REPETITIVE, CyclingLength
from tests.test_speculative_sampling import SENTENCE, copying_target, failed_positions  # noqa: F401 (a fixture)

GREEDY = SamplingParams(temperature=0, max_tokens=24)
TRAINING_PROMPTS = PROMPTS + [REPETITIVE, "import numpy as np\n", "class Stack:\n    def push(self, x):"]
SETTINGS = TrainSettings(num_heads=3, epochs=40, batch_size=32, learning_rate=1e-2, heldout_share=0.0,
                         kept_tokens=256, head_width=64)


@pytest.fixture(scope="module")
def trained_head(tiny_qwen, tmp_path_factory):
    """A head trained on the prompts the tests then run (memorised: the tests need acceptance)."""
    data = tmp_path_factory.mktemp("eagle-data") / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in TRAINING_PROMPTS))
    return train_head(str(tiny_qwen), "eagle", str(data), tmp_path_factory.mktemp("head"), settings=SETTINGS,
                      sample=len(TRAINING_PROMPTS), max_tokens=32, progress=False)


@pytest.fixture(scope="module")
def plain(tiny_qwen):
    return LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False)


def eagle(tiny_qwen, folder, **spec):
    return LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False,
               speculative={"method": "eagle", "head": str(folder), **spec})


def test_training_learns_to_draft_chains(trained_head):
    folder, result = trained_head
    first, last = result.reports[0], result.reports[-1]
    assert last.train_loss < first.train_loss
    assert last.heldout_acceptance[0] > 0.5 and last.heldout_acceptance[2] > 0.2  # (memorised)
    assert (folder / "model.safetensors").is_file() and not (folder / "checkpoint.pt").exists()
    config = json.loads((folder / "config.json").read_text())
    assert config["draftwise"]["kind"] == "eagle" and config["intermediate_size"] == 64
    assert len(config["draftwise"]["training"]["epochs"]) == 40


@pytest.mark.parametrize("branches", [1, 3])
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equality_alone_and_batched(trained_head, tiny_qwen, plain, k, adaptive, branches, drafting_pays):
    llm = eagle(tiny_qwen, trained_head[0], num_speculative_tokens=k, adaptive=adaptive, eagle_branches=branches)
    expected = [o.token_ids for o in plain.generate(TRAINING_PROMPTS, GREEDY)]
    solo = [llm.generate(p, GREEDY)[0] for p in TRAINING_PROMPTS]
    batched = llm.generate(TRAINING_PROMPTS, GREEDY)
    assert [o.token_ids for o in solo] == expected and [o.token_ids for o in batched] == expected
    assert_drafted(solo) and assert_drafted(batched)
    if branches > 1 and not adaptive:  # leaves were verified beside the chain
        assert llm.spec_metrics.num_draft_tokens > llm.spec_metrics.num_drafts * k


def test_the_head_reads_the_target_features_at_every_committed_position(trained_head, tiny_qwen):
    """What the engine hands the head over a whole request, pass after pass (prefill, verifications
    with rejections, plain steps), is the teacher-forced pass's features at positions 0..N-2, each once."""
    llm = eagle(tiny_qwen, trained_head[0], num_speculative_tokens=3, adaptive=False)
    llm.engine.drafters["eagle"].draft_length = CyclingLength([3, 0, 2, 3, 1])
    proposer = llm.engine.drafters["eagle"].proposer
    handed: list[torch.Tensor] = []
    original = proposer.on_hidden

    def spy(seqs, hidden):
        handed.extend(hidden[proposer.hidden_layers[0]])
        original(seqs, hidden)

    proposer.on_hidden = spy
    # (past the 32 tokens the head was trained on, some drafts are rejected)
    out = llm.generate(TRAINING_PROMPTS[1], SamplingParams(temperature=0, max_tokens=80))[0]
    assert llm.spec_metrics.num_accepted_tokens > 0 and llm.spec_metrics.num_draft_tokens > \
        llm.spec_metrics.num_accepted_tokens  # some drafts were rejected, some kept
    tokens = list(out.prompt_token_ids) + list(out.token_ids)
    features = proposer.to_features(torch.cat(handed))  # [N-1, H]: the last token was never fed
    expected = hidden_states(llm, tokens)[0][:-1]
    assert features.shape == expected.shape
    # Equal up to the kernels' rounding (an incremental pass and a whole one multiply in other shapes);
    # a feature one position off would differ by the features' own size.
    error = (features - expected).abs().max()
    assert error < 0.05 * expected.abs().max(), (error, expected.abs().max())
    assert (features[1:] - expected[:-1]).abs().max() > 0.2 * expected.abs().max()


def test_greedy_equality_with_plain_steps_between_drafts(trained_head, tiny_qwen, plain):
    """Plain steps: their features wait for the next draft's catch-up."""
    llm = eagle(tiny_qwen, trained_head[0], num_speculative_tokens=3, adaptive=False)
    llm.engine.drafters["eagle"].draft_length = CyclingLength([0, 3, 0, 0, 1, 3, 0, 2])
    expected = [o.token_ids for o in plain.generate(TRAINING_PROMPTS, GREEDY)]
    assert [o.token_ids for o in llm.generate(TRAINING_PROMPTS, GREEDY)] == expected
    assert llm.spec_metrics.num_plain_steps > 0 and llm.spec_metrics.num_accepted_tokens > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_max_tokens_inside_an_accepted_run(trained_head, tiny_qwen, plain, max_tokens):
    llm = eagle(tiny_qwen, trained_head[0], num_speculative_tokens=4, adaptive=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(TRAINING_PROMPTS, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(TRAINING_PROMPTS, params)]
    assert all(len(o.token_ids) == max_tokens for o in outputs)


@pytest.mark.parametrize("eos_index", [2, 4])
def test_eos_inside_an_accepted_run(trained_head, tiny_qwen, plain, monkeypatch, eos_index):
    llm = eagle(tiny_qwen, trained_head[0], num_speculative_tokens=4, adaptive=False)
    prompt = TRAINING_PROMPTS[0]
    full = plain.generate(prompt, GREEDY)[0].token_ids
    eos = full[eos_index]
    for target in (llm, plain):
        monkeypatch.setattr(target.tokenizer, "eos_token_ids", frozenset({eos}))
    out = llm.generate(prompt, GREEDY)[0]
    assert out.token_ids == full[:full.index(eos) + 1] and out.finish_reason == "stop"
    assert [o.token_ids for o in llm.generate(TRAINING_PROMPTS, GREEDY)] == \
        [o.token_ids for o in plain.generate(TRAINING_PROMPTS, GREEDY)]


def test_an_untrained_head_is_accepted_less(trained_head, tiny_qwen, tmp_path):
    trained, _ = read_eagle(trained_head[0], 64, _vocab(tiny_qwen), lambda: None)
    torch.manual_seed(0)
    save_eagle(tmp_path, EagleHead(trained.shape, trained.kept_ids), _vocab(tiny_qwen), {"kind": "eagle"})
    rates = []
    for folder in (trained_head[0], tmp_path):
        llm = eagle(tiny_qwen, folder, num_speculative_tokens=3, adaptive=False)
        llm.generate(TRAINING_PROMPTS, GREEDY)
        rates.append(llm.spec_metrics.acceptance_rate)
    assert rates[0] > rates[1] + 0.2, rates


def _vocab(tiny_qwen) -> int:
    return json.loads((tiny_qwen / "config.json").read_text())["vocab_size"]


def test_a_missing_head_names_the_command_that_makes_one(tiny_qwen, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path))
    with pytest.raises(InvalidParameterError, match="draftwise train-head --target .* --kind eagle"):
        LLM(str(tiny_qwen), max_model_len=64, progress=False, speculative={"method": "eagle"})
    with pytest.raises(InvalidParameterError, match="no EAGLE head at"):
        LLM(str(tiny_qwen), max_model_len=64, progress=False,
            speculative={"method": "eagle", "head": str(tmp_path / "nowhere")})


def test_a_medusa_head_is_not_an_eagle_head(tiny_qwen, trained_head, tmp_path):
    config = json.loads((trained_head[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "draftwise": {"kind": "medusa"}}))
    (tmp_path / "model.safetensors").write_bytes((trained_head[0] / "model.safetensors").read_bytes())
    with pytest.raises(InvalidParameterError, match="a 'medusa' head, not a 'eagle' one"):
        eagle(tiny_qwen, tmp_path)


def test_trees_for_greedy_and_seeded_rows_only(trained_head, tiny_qwen):
    llm = eagle(tiny_qwen, trained_head[0], num_speculative_tokens=3, adaptive=False, eagle_branches=3)
    proposer = llm.engine.drafters["eagle"].proposer

    class Row:
        def __init__(self, request_id, params):
            self.request_id, self.params, self.token_ids = request_id, params, [5, 6, 7]

    rows = [Row("greedy", GREEDY), Row("seeded", SamplingParams(temperature=0.8, seed=1)),
            Row("sampled", SamplingParams(temperature=0.8))]
    greedy, seeded, sampled = proposer.propose(rows, [3, 3, 3])
    assert greedy.parents is not None and seeded.parents is not None and sampled.parents is None
    # EAGLE-2's expansion: 3 children of the root, then 3 of each of the best 3 nodes, twice
    assert len(greedy.token_ids) == min(3 + 9 + 9, TREE_NODES) and greedy.depth() == 3
    assert all(p < i for i, p in enumerate(greedy.parents))
    assert all(a >= b for a, b in zip(greedy.scores, greedy.scores[1:]))  # best first
    assert all(greedy.scores[i] <= greedy.scores[p] for i, p in enumerate(greedy.parents) if p >= 0)
    # each node's first child is its most probable: the path of first children is the head's chain, as
    # deep as the expansion went along it (a node outside its level's best three has no children)
    path = greedy.first_children().token_ids
    assert len(path) >= 1 and path == sampled.token_ids[:len(path)]


def test_the_command_trains_an_eagle_head(tiny_qwen, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    result = subprocess.run([sys.executable, "-m", "draftwise", "train-head", "--target", str(tiny_qwen), "--kind",
                             "eagle", "--data", str(data), "--out", str(tmp_path / "head"), "--epochs", "1",
                             "--max-tokens", "8", "--kept-tokens", "64", "--head-width", "32"],
                            capture_output=True, text=True, timeout=300,
                            env=own_cache_env(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    assert "held-out acceptance by position" in result.stdout
    assert json.loads((tmp_path / "head" / "config.json").read_text())["intermediate_size"] == 32


def test_sampling_with_eagle_drafts_follows_the_target(copying_target, tmp_path):
    """Deterministic drafts verified by rejection sampling: every position's tokens follow the
    target's warped distribution (chi-square, as for the other drafters)."""
    prompt = " ".join([SENTENCE] * 8)
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": prompt}) + "\n" + json.dumps({"prompt": " ".join([SENTENCE] * 5)}) + "\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        folder, _ = train_head(str(copying_target), "eagle", str(data), tmp_path / "head", progress=False,
                               settings=TrainSettings(num_heads=3, epochs=20, batch_size=16, learning_rate=1e-2,
                                                      heldout_share=0.0, kept_tokens=256, head_width=32),
                               sample=2, max_tokens=24)
        llm = LLM(str(copying_target), max_model_len=128, max_num_seqs=16, progress=False,
                  speculative={"method": "eagle", "head": str(folder), "num_speculative_tokens": 3,
                               "adaptive": False})
        assert not failed_positions(llm, prompt)
    finally:
        torch.set_num_threads(threads)


def test_a_head_in_speculators_format_serves_losslessly(trained_head, tiny_qwen, plain, tmp_path):
    """The trained head, rewritten as speculators 0.3 writes EAGLE-1 (names, config; no kept
    vocabulary: it scores the target's most frequent tokens), drafts and stays exact."""
    config = json.loads((trained_head[0] / "config.json").read_text())
    tensors = load_file(str(trained_head[0] / "model.safetensors"))
    save_file({("fusion_fc." + n.removeprefix("fc.")) if n.startswith("fc.") else
               ("transformer." + n.removeprefix("layers.0.")): t for n, t in tensors.items()},
              str(tmp_path / "model.safetensors"))
    layer = {key: value for key, value in config.items() if key not in ("draftwise", "architectures")}
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["EagleSpeculator"], "speculators_model_type": "eagle", "layernorms": False,
        "fusion_bias": False, "transformer_layer_config": layer,
        "speculators_config": {"algorithm": "eagle", "verifier": {"name_or_path": "tiny"}}}))
    llm = eagle(tiny_qwen, tmp_path, num_speculative_tokens=3, adaptive=False)
    outputs = llm.generate(TRAINING_PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(TRAINING_PROMPTS, GREEDY)]
    assert llm.spec_metrics.acceptance_rate > 0.5


def test_a_failed_step_gives_the_head_its_states_again(trained_head, tiny_qwen, plain, monkeypatch):
    """A batch's step raises once (every row undone, then each run alone): the head forgets the
    requests, the target's cache re-feeds them whole, and the head drafts from true states again
    (from zero features it would accept far less)."""
    llm = eagle(tiny_qwen, trained_head[0], num_speculative_tokens=3, adaptive=False)
    forward, failed = llm.runner.forward, []

    def fails_once(rows, token_ids, num_logits, **kwargs):
        decoding = len(rows) >= 3 and all(len(ids) <= 4 for ids in token_ids)  # (drafts of <= 3 after a token)
        if decoding and not failed:
            failed.append(len(rows))
            raise RuntimeError("injected fault")
        return forward(rows, token_ids, num_logits, **kwargs)

    monkeypatch.setattr(llm.runner, "forward", fails_once)
    outputs = llm.generate(TRAINING_PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(TRAINING_PROMPTS, GREEDY)]
    assert failed and all(len(o.token_ids) > 8 for o in outputs)  # the fault struck mid-request
    assert llm.spec_metrics.acceptance_rate > 0.7, llm.spec_metrics.acceptance_rate


def test_structured_outputs_equal_plain_constrained_decoding(trained_head, tiny_qwen, plain, drafting_pays):
    llm = eagle(tiny_qwen, trained_head[0], num_speculative_tokens=3)
    assert_constrained_equal(llm, plain, TRAINING_PROMPTS)
