"""`draftwise bench` on a tiny model: the report, JSON and plots, and an equality check that flags a
config whose outputs differ from plain decoding."""

import json

import pytest
import torch

from draftwise import LLM, SamplingParams
from draftwise.benchmark.datasets import load_prompts
from draftwise.benchmark.report import markdown, write_outputs
from draftwise.benchmark.runner import RequestResult, draftwise_configs, parse_config, run_benchmark, summarize
from draftwise.errors import InvalidParameterError
from draftwise.speculative.verify import VerifyResult, verify
from tests.clocks import TickingClock


@pytest.fixture
def prompts(tmp_path, tiny_qwen):
    traffic = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "def add(a, b):", "category": "code"}, {"prompt": "for i in range(3):", "category": "code"},
            {"messages": [{"role": "user", "content": "hello"}], "category": "chat"}]
    traffic.write_text("\n".join(json.dumps(r) for r in rows))
    def make_llm():
        return LLM(str(tiny_qwen), max_num_seqs=1, max_model_len=256, progress=False)

    return make_llm, load_prompts(str(traffic), make_llm().tokenizer, per_category=5)


def test_bench_reports_every_config_and_category(prompts, tiny_qwen, tmp_path, monkeypatch, drafting_pays):
    """With a clock that ticks once per step of a request (batch 1), tokens per second are tokens
    per step: 1 for plain decoding, and the speedup is the gain in tokens per step."""
    TickingClock(monkeypatch, "draftwise.engine.sequence")
    make_llm, items = prompts
    params = SamplingParams(temperature=0.0, max_tokens=12)
    contestants = draftwise_configs(make_llm, ["ngram:k=2", "draft:k<=3", "draft:k=1"], params,
                                    {"draft": {"model": str(tiny_qwen)}})
    assert len({id(c.llm) for c in contestants}) == 4  # one LLM per config
    results = run_benchmark(contestants, items, progress=False)
    summary = summarize(results)
    assert list(summary) == ["plain", "ngram:k=2", "draft:k<=3", "draft:k=1"]
    assert set(summary["plain"]) == {"code", "chat", "all"}
    for name, by_category in summary.items():
        assert by_category["all"]["equal_to_plain"] == 3, name
        assert by_category["all"]["requests"] == 3
        assert name == "plain" or by_category["all"]["acceptance_rate"] is not None, name  # it drafted
    assert summary["plain"]["all"]["speedup"] == 1.0 and summary["plain"]["all"]["tau"] == 1.0
    assert summary["plain"]["all"]["tokens_per_s"] == 1.0
    assert summary["plain"]["all"]["acceptance_rate"] is None  # no drafter: "-", not 0%
    for name in ("draft:k<=3", "draft:k=1"):  # the target drafting for itself
        assert summary[name]["all"]["acceptance_rate"] == 1.0 and summary[name]["all"]["speedup"] > 1.5
    assert summary["draft:k=1"]["all"]["acceptance_by_position"] == [1.0]
    assert summary["draft:k=1"]["all"]["tau"] > 1.5
    paths = write_outputs(results, summary, tmp_path / "out", "tiny")
    saved = json.loads(paths["json"].read_text())
    assert set(saved["summary"]) == set(summary) and len(saved["requests"]["plain"]) == 3
    for key in ("speedup_by_category", "acceptance_by_position", "speedup_vs_k"):
        assert paths[key].stat().st_size > 1000
    assert "| draft:k<=3 |" in paths["markdown"].read_text()


def test_equality_check_flags_a_diverging_config(prompts, random_draft, monkeypatch):
    """A verifier that accepts every drafted token (a random draft's included) must show up."""
    def accept_everything(draft_token_ids, num_draft, target_logits, *args, **kwargs):
        honest = verify(draft_token_ids, num_draft, target_logits, *args, **kwargs)
        width = draft_token_ids.shape[1]
        output = honest.output_token_ids.clone()
        take = torch.arange(width)[None, :] < num_draft[:, None]
        output[:, :width] = torch.where(take, draft_token_ids, -1)
        output[torch.arange(len(num_draft)), num_draft] = target_logits.argmax(-1)[torch.arange(len(num_draft)), num_draft]
        return VerifyResult(output, num_draft.clone())

    monkeypatch.setattr("draftwise.engine.engine.verify", accept_everything)
    make_llm, items = prompts
    contestants = draftwise_configs(make_llm, ["draft:k=3"], SamplingParams(temperature=0.0, max_tokens=12),
                                    {"draft": {"model": str(random_draft)}})
    results = run_benchmark(contestants, items, progress=False)
    summary = summarize(results)
    assert summary["plain"]["all"]["equal_to_plain"] == 3
    assert summary["draft:k=3"]["all"]["equal_to_plain"] < 3
    assert "| draft:k=3 |" in markdown(summary)


def test_config_syntax():
    assert parse_config("plain") is None
    assert parse_config("ngram:k=2") == {"method": "ngram", "num_speculative_tokens": 2, "adaptive": False}
    assert parse_config("draft", {"draft": {"model": "m"}}) == {"method": "draft", "num_speculative_tokens": 8,
                                                                 "adaptive": True, "model": "m"}
    assert parse_config("layer_skip:k<=4", {"layer_skip": {"num_layers": 3}, "draft": {"model": "m"}}) == {
        "method": "layer_skip", "num_speculative_tokens": 4, "adaptive": True, "num_layers": 3}
    for bad in ("medusa", "ngram:k=", "draft:k=0", "ngram:4"):
        with pytest.raises(InvalidParameterError, match="config|k must"):
            parse_config(bad)


def test_hf_peers_run_on_the_same_gguf(tiny_qwen_gguf, prompts, monkeypatch):
    """transformers on the tiny GGUF: plain, assistant and prompt lookup agree with HF's own plain decoding."""
    pytest.importorskip("transformers")
    TickingClock(monkeypatch, "draftwise.benchmark.peers")  # one tick per request: tokens per second = tokens
    from draftwise.benchmark.peers import hf_configs

    make_llm, items = prompts
    ours = draftwise_configs(make_llm, [], SamplingParams(temperature=0.0, max_tokens=8))
    peers = hf_configs(str(tiny_qwen_gguf), str(tiny_qwen_gguf), 8)
    summary = summarize(run_benchmark(ours + peers, items, progress=False))
    assert list(summary) == ["plain", "hf plain", "hf prompt lookup", "hf assistant"]
    for name in ("hf plain", "hf prompt lookup", "hf assistant"):
        assert summary[name]["all"]["equal_to_plain"] == 3, name
        assert summary[name]["all"]["tau"] is None
        assert summary[name]["all"]["tokens_per_s"] == summary[name]["all"]["tokens"] / 3
        assert summary[name]["all"]["acceptance_rate"] is None
    assert "| hf assistant |" in markdown(summary)


def test_configs_run_interleaved_prompt_by_prompt_with_the_first_rotating():
    """The machine drifts over a run; every prompt runs under every config before the next prompt."""
    calls = []

    class Recorder:
        def __init__(self, name):
            self.name, self.reference = name, "a"

        def warm_up(self, prompt):
            calls.append(("warm-up", self.name))

        def run(self, category, prompt):
            calls.append((prompt, self.name))
            return RequestResult(category, 1, 1.0, 0.0, [len(calls)], 0)

    items = [("x", "p0"), ("x", "p1"), ("y", "p2")]
    results = run_benchmark([Recorder("a"), Recorder("b"), Recorder("c")], items, progress=False)
    assert calls[:3] == [("warm-up", "a"), ("warm-up", "b"), ("warm-up", "c")]
    assert calls[3:] == [("p0", "a"), ("p0", "b"), ("p0", "c"), ("p1", "b"), ("p1", "c"), ("p1", "a"),
                         ("p2", "c"), ("p2", "a"), ("p2", "b")]
    assert [r.name for r in results] == ["a", "b", "c"]
    assert [[q.category for q in r.requests] for r in results] == [["x", "x", "y"]] * 3


def test_spec_bench_mt_bench_prompts_cover_its_subcategories(tmp_path, monkeypatch, prompts):
    """The file holds MT-bench in blocks of ten per subcategory; 3 MT-bench prompts must not be 3 writing ones."""
    make_llm, _ = prompts
    rows = [{"category": c, "turns": [f"{c} {i}"]} for c in ("writing", "roleplay", "reasoning") for i in range(3)]
    rows += [{"category": "qa", "turns": [f"qa {i}"]} for i in range(3)]
    (tmp_path / "spec_bench_question.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    monkeypatch.setenv("DRAFTWISE_DATA", str(tmp_path))
    chosen = load_prompts("spec-bench", make_llm().tokenizer, per_category=4)
    assert [c for c, _ in chosen] == ["mt_bench"] * 4 + ["qa"] * 3
    mt_bench = [prompt for category, prompt in chosen if category == "mt_bench"]
    for expected, prompt in zip(["writing 0", "roleplay 0", "reasoning 0", "writing 1"], mt_bench):
        assert expected in prompt
