"""Medusa heads: trained here on the tiny model's own answers, lossless as a drafter, stored and refused
by name."""

import json
import subprocess
import sys

import pytest
import torch

from draftwise import LLM, SamplingParams
from draftwise.errors import InvalidParameterError
from draftwise.speculative.drafters.medusa import load_heads
from draftwise.speculative.heads.medusa import MedusaHeads
from draftwise.speculative.heads.medusa_training import IGNORED, acceptance_per_position, kept_index_map, positions
from draftwise.speculative.heads.store import save_head
from draftwise.speculative.heads.training import Example, TrainSettings
from draftwise.training.train_head import train_head
from tests.cache_env import own_cache_env
from tests.drafting import assert_constrained_equal, assert_drafted
from tests.test_spec_equality import PROMPTS, REPETITIVE, CyclingLength
from tests.test_speculative_sampling import SENTENCE, copying_target, failed_positions  # noqa: F401 (a fixture)

GREEDY = SamplingParams(temperature=0, max_tokens=24)
TRAINING_PROMPTS = PROMPTS + [REPETITIVE, "import numpy as np\n", "class Stack:\n    def push(self, x):"]


@pytest.fixture(scope="module")
def trained_head(tiny_qwen, tmp_path_factory):
    """A head trained on the prompts the tests then run (memorised: the tests need acceptance)."""
    data = tmp_path_factory.mktemp("medusa-data") / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in TRAINING_PROMPTS))
    folder, result = train_head(str(tiny_qwen), "medusa", str(data), tmp_path_factory.mktemp("head"),
                                settings=TrainSettings(num_heads=3, epochs=30, batch_size=32, learning_rate=3e-2,
                                                       heldout_share=0.0, kept_tokens=256),
                                sample=len(TRAINING_PROMPTS), max_tokens=32, progress=False)
    return folder, result


@pytest.fixture(scope="module")
def plain(tiny_qwen):
    return LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False)


def medusa(tiny_qwen, folder, **spec):
    return LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=8, progress=False,
               speculative={"method": "medusa", "head": str(folder), **spec})


def test_training_learns_what_the_target_says_next(trained_head):
    folder, result = trained_head
    first, last = result.reports[0], result.reports[-1]
    assert last.train_loss < first.train_loss
    assert last.heldout_acceptance[0] > 0.5  # (the held-out split is the training set here: memorised)
    assert (folder / "head.safetensors").is_file() and not (folder / "checkpoint.pt").exists()
    config = json.loads((folder / "config.json").read_text())
    assert config["kind"] == "medusa" and config["num_heads"] == 3 and len(config["training"]["epochs"]) == 30


@pytest.mark.parametrize("branches", [1, 3])
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equality_alone_and_batched(trained_head, tiny_qwen, plain, k, adaptive, branches, drafting_pays):
    """branches 3: token trees (the chain and two leaves beside each of its tokens)."""
    llm = medusa(tiny_qwen, trained_head[0], num_speculative_tokens=k, adaptive=adaptive, medusa_branches=branches)
    prompts = TRAINING_PROMPTS
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    solo = [llm.generate(p, GREEDY)[0] for p in prompts]
    batched = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in solo] == expected and [o.token_ids for o in batched] == expected
    assert_drafted(solo) and assert_drafted(batched)
    if branches > 1 and not adaptive:  # leaves were verified beside the chain
        assert llm.spec_metrics.num_draft_tokens > llm.spec_metrics.num_drafts * k


def test_greedy_equality_with_plain_steps_between_drafts(trained_head, tiny_qwen, plain):
    """Runs of plain steps: the hidden state is taken from every pass, drafting or not."""
    llm = medusa(tiny_qwen, trained_head[0], num_speculative_tokens=3, adaptive=False)
    llm.engine.drafters["medusa"].draft_length = CyclingLength([0, 3, 0, 0, 1, 3, 0, 2])
    expected = [o.token_ids for o in plain.generate(TRAINING_PROMPTS, GREEDY)]
    assert [o.token_ids for o in llm.generate(TRAINING_PROMPTS, GREEDY)] == expected
    assert llm.spec_metrics.num_plain_steps > 0 and llm.spec_metrics.num_accepted_tokens > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_max_tokens_inside_an_accepted_run(trained_head, tiny_qwen, plain, max_tokens):
    llm = medusa(tiny_qwen, trained_head[0], num_speculative_tokens=3, adaptive=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(TRAINING_PROMPTS, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(TRAINING_PROMPTS, params)]
    assert all(len(o.token_ids) == max_tokens for o in outputs)


@pytest.mark.parametrize("eos_index", [2, 4])
def test_eos_inside_an_accepted_run(trained_head, tiny_qwen, plain, monkeypatch, eos_index):
    llm = medusa(tiny_qwen, trained_head[0], num_speculative_tokens=3, adaptive=False)
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
    """The trained head's acceptance comes from training: the same heads at their initial zeros
    (each proposing the LM head's guess for the next token, one position early) are right far less."""
    trained = load_heads(trained_head[0], 64, _vocab(tiny_qwen))
    untrained = MedusaHeads(64, 3, trained.kept_ids)
    save_head(tmp_path, untrained.state_dict(), {"kind": "medusa", "num_heads": 3, "hidden_size": 64,
                                                 "vocab_size": _vocab(tiny_qwen), "target": "tiny"})
    rates = []
    for folder in (trained_head[0], tmp_path):
        llm = medusa(tiny_qwen, folder, num_speculative_tokens=3, adaptive=False)
        llm.generate(TRAINING_PROMPTS, GREEDY)
        rates.append(llm.spec_metrics.acceptance_rate)
    assert rates[0] > rates[1] + 0.2, rates


def _vocab(tiny_qwen) -> int:
    return json.loads((tiny_qwen / "config.json").read_text())["vocab_size"]


def test_positions_and_acceptance_per_position():
    """Head i learns token t + 2 + i from position t >= answer start - 1; a chain is right up to its
    first wrong head."""
    tokens = torch.tensor([5, 6, 7, 8, 9])
    example = Example(tokens, answer_start=2, hidden=torch.arange(5.0)[:, None].repeat(1, 4))
    index = kept_index_map(torch.tensor([5, 6, 7, 8]), 10)  # 9 is not kept
    inputs, targets = positions([example], index, num_heads=2)
    assert inputs[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]  # from position 1 (predicting token 2) on
    assert targets.tolist() == [[index[8], IGNORED], [IGNORED, IGNORED], [IGNORED, IGNORED], [IGNORED, IGNORED]]

    class Fixed(MedusaHeads):
        def logits(self, hidden, lm_rows):
            right = torch.tensor([[1, 1], [1, 0], [0, 1], [0, 0]])  # [P, K] whether each head is right
            return torch.nn.functional.one_hot(torch.where(right.bool(), torch.tensor([0, 1]), 2), 3).float()

    acceptance = acceptance_per_position(Fixed(4, 2, torch.tensor([0, 1, 2])), None, torch.zeros(4, 4),
                                         torch.tensor([[0, 1]] * 4))
    assert acceptance == [0.5, 0.25]


def test_a_missing_head_names_the_command_that_makes_one(tiny_qwen, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path))
    with pytest.raises(InvalidParameterError, match="draftwise train-head --target .* --kind medusa"):
        LLM(str(tiny_qwen), max_model_len=64, progress=False, speculative={"method": "medusa"})
    with pytest.raises(InvalidParameterError, match="no Medusa head at"):
        LLM(str(tiny_qwen), max_model_len=64, progress=False,
            speculative={"method": "medusa", "head": str(tmp_path / "nowhere")})


def test_trees_for_greedy_and_seeded_rows_only(trained_head, tiny_qwen):
    llm = medusa(tiny_qwen, trained_head[0], num_speculative_tokens=3, adaptive=False, medusa_branches=3)
    proposer = llm.engine.drafters["medusa"].proposer

    class Row:
        def __init__(self, request_id, params):
            self.request_id, self.params = request_id, params

    rows = [Row("greedy", GREEDY), Row("seeded", SamplingParams(temperature=0.8, seed=1)),
            Row("sampled", SamplingParams(temperature=0.8))]
    greedy, seeded, sampled = proposer.propose(rows, [3, 3, 3])
    assert greedy.parents is not None and seeded.parents is not None and sampled.parents is None
    assert greedy.kept_nodes == 3 and len(greedy.token_ids) == 3 + 3 * 2
    assert greedy.token_ids[:3] == sampled.token_ids  # the chain is each head's best
    assert all(a >= b for a, b in zip(greedy.scores[3:], greedy.scores[4:]))  # leaves best first


def test_a_head_for_another_target_is_refused(trained_head, tiny_qwen, tmp_path):
    config = json.loads((trained_head[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    (tmp_path / "head.safetensors").write_bytes((trained_head[0] / "head.safetensors").read_bytes())
    with pytest.raises(InvalidParameterError, match="trained for hidden size 128"):
        medusa(tiny_qwen, tmp_path)


def test_a_drafter_without_a_head_is_refused_by_name(tiny_qwen, tmp_path):
    with pytest.raises(InvalidParameterError, match="--kind 'ngram' cannot be trained; heads that can: .*medusa"):
        train_head(str(tiny_qwen), "ngram", str(tmp_path / "x.jsonl"), tmp_path, progress=False)


def test_the_command_trains_and_writes_a_head(tiny_qwen, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    result = subprocess.run([sys.executable, "-m", "draftwise", "train-head", "--target", str(tiny_qwen), "--kind", "medusa",
                             "--data", str(data), "--out", str(tmp_path / "head"), "--epochs", "1",
                             "--max-tokens", "8", "--kept-tokens", "64"], capture_output=True, text=True, timeout=300,
                            env=own_cache_env(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    assert "held-out acceptance by position" in result.stdout and (tmp_path / "head" / "head.safetensors").is_file()


def test_sampling_with_medusa_drafts_follows_the_target(copying_target, tmp_path):
    """Deterministic drafts (probability 1 on the drafted token) verified by rejection sampling: every
    position's tokens follow the target's warped distribution (chi-square, as for the other drafters).
    The target copies its text with p ~ 0.6, and a head trained on it proposes the copy."""
    prompt = " ".join([SENTENCE] * 8)
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": prompt}) + "\n" + json.dumps({"prompt": " ".join([SENTENCE] * 5)}) + "\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        folder, _ = train_head(str(copying_target), "medusa", str(data), tmp_path / "head", progress=False,
                               settings=TrainSettings(num_heads=3, epochs=20, batch_size=16, learning_rate=3e-2,
                                                      heldout_share=0.0, kept_tokens=256), sample=2, max_tokens=24)
        llm = LLM(str(copying_target), max_model_len=128, max_num_seqs=16, progress=False,
                  speculative={"method": "medusa", "head": str(folder), "num_speculative_tokens": 3,
                               "adaptive": False})
        assert not failed_positions(llm, prompt)
    finally:
        torch.set_num_threads(threads)


def test_k_is_capped_at_the_number_of_heads(trained_head, tiny_qwen):
    llm = medusa(tiny_qwen, trained_head[0], num_speculative_tokens=8, adaptive=False)
    assert llm.engine.drafters["medusa"].max_tokens == 3
    llm.generate(TRAINING_PROMPTS[0], GREEDY)
    assert max(drafted for drafted, _ in llm.spec_metrics.steps or [(3, 0)]) <= 3
    assert len(llm.spec_metrics.drafted_per_position) == 3


def test_structured_outputs_equal_plain_constrained_decoding(trained_head, tiny_qwen, plain, drafting_pays):
    llm = medusa(tiny_qwen, trained_head[0], num_speculative_tokens=3)
    assert_constrained_equal(llm, plain, TRAINING_PROMPTS)
