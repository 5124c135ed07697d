"""`draftwise bench` on tiny models: every suite end to end with its control ratio, the runner's
interleaving and its process per config, the one speedup definition, peers run or shown absent,
and the equality check that flags a config whose outputs differ from plain decoding's."""

import json
import math
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from draftwise.benchmark.configs import CONTROL, LLMRecipe, config_recipes, parse_config
from draftwise.benchmark.datasets import load_prompts
from draftwise.benchmark.peers import peer_recipes
from draftwise.benchmark.probes import BuildInfo
from draftwise.benchmark.report import speedup_tables
from draftwise.benchmark.runner import ConfigResult, RequestResult, lineup, run_benchmark
from draftwise.benchmark.suites import BenchSettings, run_suite
from draftwise.benchmark.suites.concurrency import LOOP_ROUNDS
from draftwise.benchmark.summary import speedup, summarize
from draftwise.cli import main
from draftwise.cli.speculative_flags import speculative_arguments
from draftwise.errors import InvalidParameterError
from draftwise.quant.native import amx_kernels
from draftwise.sampling.params import SamplingParams
from draftwise.speculative.verify import VerifyResult, verify
from draftwise.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def traffic(tmp_path_factory):
    path = tmp_path_factory.mktemp("traffic") / "prompts.jsonl"
    rows = [{"prompt": "def add(a, b):", "category": "code"}, {"prompt": "for i in range(3):", "category": "code"},
            {"messages": [{"role": "user", "content": "hello"}], "category": "chat"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


@pytest.fixture
def fast_profiles(monkeypatch, tmp_path):
    """A synthetic cost model instead of timing the tiny model (adaptive configs need one), cached
    apart from the session's profiles so that no other test reads it."""
    from draftwise.speculative.control import profile
    from draftwise.speculative.control.cost_model import CostModel

    monkeypatch.setenv(profile.PROFILES_ENV, str(tmp_path / "synthetic-profiles"))

    def measure(runner, proposer, tokenizer, max_draft_tokens):
        return CostModel({n: 0.01 + 0.002 * n for n in profile.TARGET_SIZES},
                         {k: 0.002 * k for k in range(1, max_draft_tokens + 1)} if proposer else {})

    monkeypatch.setattr(profile, "measure", measure)


@pytest.fixture
def settings(tmp_path, tiny_qwen, traffic):
    return BenchSettings(output=tmp_path / "out", model=str(tiny_qwen), datasets=(str(traffic),), per_category=5,
                         max_tokens=8, isolation="in-process", max_model_len=512, progress=False,
                         options={"draft": {"model": str(tiny_qwen)}})


def control_ratio(markdown: str) -> float:
    return float(re.search(r"Control: `[^`]+` is `[^`]+` again.*?\*\*([0-9.]+)x\*\*", markdown).group(1))


def test_speculative_suite_reports_every_config_category_and_the_control(settings, fast_profiles):
    report = run_suite("speculative", replace(settings, configs=("ngram:k=2", "draft:k<=3", "draft:k=1")))
    summary = report.data["summary"]
    assert list(summary) == ["plain", "ngram:k=2", "draft:k<=3", "draft:k=1", CONTROL]
    assert set(summary["plain"]) == {"code", "chat", "all"}
    for name, by_category in summary.items():
        assert by_category["all"]["equal_to_plain"] == 3, name
        assert by_category["all"]["requests"] == 3 and by_category["all"]["tokens_per_s"] > 0
    assert summary["plain"]["all"]["speedup"] == 1.0 and summary["plain"]["all"]["tau"] == 1.0
    assert summary["plain"]["all"]["acceptance_rate"] is None  # no drafter: "-", not 0%
    assert summary["draft:k=1"]["all"]["acceptance_by_position"] == [1.0]  # the target drafting for itself
    assert summary["draft:k=1"]["all"]["tau"] > 1.5
    assert control_ratio(report.markdown) == pytest.approx(summary[CONTROL]["all"]["speedup"], abs=0.006)
    assert f"| {CONTROL} |" in report.markdown and "| draft:k<=3 |" in report.markdown
    assert "| hf (transformers) | not run (--peers hf runs it) |" in report.markdown  # absent, not quoted
    for path in report.plots.values():
        assert path.stat().st_size > 1000


def test_equality_check_flags_a_diverging_config(settings, random_draft, monkeypatch, traffic):
    """A verifier that accepts every drafted token (a random draft's included) must show up."""
    def accept_everything(draft_token_ids, num_draft, target_logits, *args, **kwargs):
        honest = verify(draft_token_ids, num_draft, target_logits, *args, **kwargs)
        width = draft_token_ids.shape[1]
        output = honest.output_token_ids.clone()
        take = torch.arange(width)[None, :] < num_draft[:, None]
        output[:, :width] = torch.where(take, draft_token_ids, -1)
        rows = torch.arange(len(num_draft))
        output[rows, num_draft] = target_logits.argmax(-1)[rows, num_draft]
        return VerifyResult(output, num_draft.clone())

    monkeypatch.setattr("draftwise.engine.engine.verify", accept_everything)
    report = run_suite("speculative", replace(settings, configs=("draft:k=3",),
                                              options={"draft": {"model": str(random_draft)}}))
    summary = report.data["summary"]
    assert summary["plain"]["all"]["equal_to_plain"] == summary[CONTROL]["all"]["equal_to_plain"] == 3
    assert summary["draft:k=3"]["all"]["equal_to_plain"] < 3
    assert re.search(r"\| draft:k=3 \|.*\| [0-2]/3 \|", report.markdown)


def test_config_syntax():
    assert parse_config("plain") is None
    assert parse_config("ngram:k=2") == {"method": "ngram", "num_speculative_tokens": 2, "adaptive": False}
    assert parse_config("draft", {"draft": {"model": "m"}}) == {"method": "draft", "num_speculative_tokens": 8,
                                                                 "adaptive": True, "model": "m"}
    assert parse_config("layer_skip:k<=4", {"layer_skip": {"num_layers": 3}, "draft": {"model": "m"}}) == {
        "method": "layer_skip", "num_speculative_tokens": 4, "adaptive": True, "num_layers": 3}
    # a drafter's options in the config, after the run's: two configs of one drafter side by side
    assert parse_config("draft:k<=6:draft_branches=2", {"draft": {"model": "m", "draft_branches": 1}}) == {
        "method": "draft", "num_speculative_tokens": 6, "adaptive": True, "model": "m", "draft_branches": 2}
    assert parse_config("suffix:suffix_min_probability=0.2")["suffix_min_probability"] == 0.2
    for bad in ("no_such_drafter", "ngram:k=", "draft:k=0", "ngram:4", "draft:draft_branches", "draft:=2"):
        with pytest.raises(InvalidParameterError, match="config|k must"):
            parse_config(bad)


def test_speedup_is_total_tokens_over_total_seconds():
    """One definition: (sum tokens / sum seconds) of the config over the same of plain. A mean of
    per-prompt ratios (1.5 here) or Spec-Bench's ratio of mean per-prompt speeds (1.9) would differ."""
    def config(name, seconds):
        return ConfigResult(name, requests=[RequestResult("x", 10, s, 0.1, [1] * 10, 9) for s in seconds])

    plain, faster = config("plain", [1.0, 9.0]), config("fast", [0.5, 9.0])
    assert speedup(20, 9.5, 20, 10.0) == pytest.approx(10 / 9.5)
    assert summarize([plain, faster])["fast"]["all"]["speedup"] == pytest.approx((20 / 9.5) / (20 / 10.0))
    assert speedup(5, 1.0, 0, 0.0) == 0.0  # a baseline that produced nothing


def test_configs_run_interleaved_item_by_item_with_the_first_rotating():
    """The machine drifts over a run; every item runs under every config before the next item."""
    calls = []

    class Recorder:
        def __init__(self, name):
            self.name, self.reference = name, "a"

        def warm_up(self, prompt):
            calls.append(("warm-up", self.name))

        def run(self, item):
            calls.append((item if isinstance(item, str) else item[1], self.name))
            return RequestResult(item[0], 1, 1.0, 0.0, [len(calls)], 0) if isinstance(item, tuple) else {"n": 1}

    items = [("x", "p0"), ("x", "p1"), ("y", "p2"), "probe"]
    results = run_benchmark([Recorder("a"), Recorder("b"), Recorder("c")], items, progress=False)
    assert calls[:3] == [("warm-up", "a"), ("warm-up", "b"), ("warm-up", "c")]
    assert calls[3:] == [("p0", "a"), ("p0", "b"), ("p0", "c"), ("p1", "b"), ("p1", "c"), ("p1", "a"),
                         ("p2", "c"), ("p2", "a"), ("p2", "b"), ("probe", "a"), ("probe", "b"), ("probe", "c")]
    assert [r.name for r in results] == ["a", "b", "c"]
    assert [[q.category for q in r.requests] for r in results] == [["x", "x", "y"]] * 3
    assert [r.measures for r in results] == [[{"n": 1}]] * 3


def test_ctrl_c_keeps_every_item_all_configs_finished_and_the_cli_writes_them(tiny_qwen, traffic, tmp_path, monkeypatch):
    """A run interrupted inside an item keeps the items before it, paired across configs (the
    interrupted item's answers dropped), and `draftwise bench` writes them before it exits 130."""
    from draftwise.benchmark import suites
    from draftwise.benchmark.runner import BenchmarkInterrupted

    class Recorder:
        def __init__(self, name, stop_at=None):
            self.name, self.reference, self.stop_at = name, "a", stop_at

        def warm_up(self, prompt):
            pass

        def run(self, item):
            if item == self.stop_at:
                raise KeyboardInterrupt
            return RequestResult(item[0], 1, 1.0, 0.0, [1], 0) if isinstance(item, tuple) else {"n": 1}

    items = [("x", "p0"), ("x", "p1"), ("y", "p2"), ("y", "p3"), "probe"]
    with pytest.raises(BenchmarkInterrupted) as stop:  # (p2 runs c, a, then b stops)
        run_benchmark([Recorder("a"), Recorder("b", stop_at=("y", "p2")), Recorder("c")], items, progress=False)
    assert (stop.value.done, stop.value.total) == (2, 5)
    assert [[q.category for q in r.requests] for r in stop.value.results] == [["x", "x"]] * 3
    assert [r.measures for r in stop.value.results] == [[]] * 3

    def interrupted(name, settings):
        raise BenchmarkInterrupted(stop.value.results, 2, 5)

    monkeypatch.setattr(suites, "run_suite", interrupted)
    argv = ["bench", "--suite", "plain", "--model", str(tiny_qwen), "--dataset", str(traffic), "--formats", "none",
            "--in-process", "--output", str(tmp_path / "out")]
    assert main(argv) == 130
    saved = json.loads((tmp_path / "out" / "plain-interrupted.json").read_text())
    assert saved["items_finished"] == 2 and [c["name"] for c in saved["configs"]] == ["a", "b", "c"]
    assert len(saved["configs"][0]["requests"]) == 2


@pytest.mark.parametrize("argv, message", [
    (["--suite", "speculative", "--peers", "hf", "--temperature", "0.7"], "greedily"),
    (["--suite", "prefix-cache", "--per-category", "1"], "at least 2"),
])
def test_bench_runs_that_would_measure_the_wrong_thing_are_refused(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_percentiles_interpolate_between_ranks_as_numpy_does():
    from draftwise.stats import percentile

    assert percentile(list(range(1, 21)), 0.95) == pytest.approx(19.05)  # (was 20: the maximum)
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == pytest.approx(2.5)  # unsorted; the median
    assert percentile([5.0], 0.99) == 5.0 and percentile([], 0.5) == 0.0


def test_warm_up_leaves_no_cached_prefix_for_the_first_item(tiny_qwen):
    """The warm-up prompt is the first item's: its prefill is measured, not found in the cache."""
    from draftwise import LLM
    from draftwise.benchmark.configs import DraftwiseConfig

    llm = LLM(str(tiny_qwen), max_model_len=512, progress=False)
    config = DraftwiseConfig("plain", llm, SamplingParams(temperature=0.0, max_tokens=4))
    prompt = "You are a careful assistant. " * 8 + "def add(a, b):"
    config.warm_up(prompt)
    config.run(("x", prompt))
    assert llm.engine_stats()["prefix_cache_hits"] == 0


def test_background_load_runs_from_its_start_item_to_the_end_under_every_config():
    """`--background-load 1@0.5`: busy from the item at half the run, for every contestant of that
    item alike (the load starts between items), and ended with the run."""
    from draftwise.benchmark.background_load import BackgroundLoad
    from draftwise.errors import InvalidParameterError

    load = BackgroundLoad.parse("1@0.5")
    busy = []

    class Recorder:
        def __init__(self, name):
            self.name, self.reference = name, "a"

        def warm_up(self, prompt):
            pass

        def run(self, item):
            busy.append((item[1], self.name, any(p.is_alive() for p in load._running)))
            return RequestResult(item[0], 1, 1.0, 0.0, [1], 0)

    items = [("x", f"p{i}") for i in range(4)]
    run_benchmark([Recorder("a"), Recorder("b")], items, progress=False, load=load)
    assert [(prompt, loaded) for prompt, _, loaded in busy] == [
        ("p0", False), ("p0", False), ("p1", False), ("p1", False),
        ("p2", True), ("p2", True), ("p3", True), ("p3", True)]
    assert load.started_at_item == 2 and load._running == []  # stopped with the run
    for bad in ("two@0.5", "0@0.5", "2@1.5"):
        with pytest.raises(InvalidParameterError, match="background"):
            BackgroundLoad.parse(bad)


def test_each_config_runs_in_a_process_of_its_own(tiny_qwen, traffic):
    """Plain and its control, each built and run in its own worker process."""
    params = SamplingParams(temperature=0.0, max_tokens=6)
    items = load_prompts(str(traffic), Tokenizer(tiny_qwen), per_category=1)[:1] + [BuildInfo()]
    with lineup(config_recipes(LLMRecipe(str(tiny_qwen), max_model_len=256), [], params)) as contestants:
        pids = [c.pid for c in contestants]
        results = run_benchmark(contestants, items, progress=False)
        processes = [c.worker.process for c in contestants]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert [r.measures[0]["pid"] for r in results] == pids  # each computed where it was built
    assert [r.name for r in results] == ["plain", CONTROL]
    assert all(r.requests[0].token_ids == results[0].requests[0].token_ids for r in results)
    assert not any(process.is_alive() for process in processes)


def test_a_worker_error_reaches_the_parent(tmp_path):
    recipe = config_recipes(LLMRecipe(str(tmp_path / "missing")), [], SamplingParams())[:1]
    with pytest.raises(Exception, match="missing"):
        with lineup(recipe):
            pass


def test_peers_run_on_the_same_gguf_or_show_as_absent(tiny_qwen, tiny_qwen_gguf, traffic):
    """transformers on the tiny GGUF: plain, assistant and prompt lookup agree with HF's own plain
    decoding; a peer not asked for, or unable to run, is a "not run" row."""
    assert peer_recipes((), str(tiny_qwen_gguf), None, 8) == ([], {"hf (transformers)": "--peers hf runs it"})
    assert peer_recipes(("hf",), str(tiny_qwen), None, 8)[1] == {"hf (transformers)": "it needs a GGUF model"}
    pytest.importorskip("transformers")
    peers, absent = peer_recipes(("hf",), str(tiny_qwen_gguf), str(tiny_qwen_gguf), 8)
    assert absent == {}
    params = SamplingParams(temperature=0.0, max_tokens=8)
    items = load_prompts(str(traffic), Tokenizer(tiny_qwen), per_category=5)
    ours = config_recipes(LLMRecipe(str(tiny_qwen), max_model_len=256), [], params)
    with lineup(ours + peers, "in-process") as contestants:
        summary = summarize(run_benchmark(contestants, items, progress=False))
    assert list(summary) == ["plain", CONTROL, "hf plain", "hf prompt lookup", "hf assistant"]
    for name in ("hf plain", "hf prompt lookup", "hf assistant"):
        assert summary[name]["all"]["equal_to_plain"] == 3, name
        assert summary[name]["all"]["tau"] is None and summary[name]["all"]["tokens_per_s"] > 0
        assert summary[name]["all"]["acceptance_rate"] is None
    assert "| hf assistant |" in speedup_tables(summary)
    assert "| hf (transformers) | not run (it needs a GGUF model) |" in speedup_tables(
        summary, {"hf (transformers)": "it needs a GGUF model"})


def test_adaptive_suite_sets_adaptive_against_fixed_k(settings, fast_profiles):
    report = run_suite("adaptive", replace(settings, configs=("ngram", "ngram:k=2")))
    assert list(report.data["summary"]) == ["plain", "ngram", "ngram:k=2", CONTROL]
    assert re.search(r"\| ngram \| ngram:k=2 \| [0-9.]+x / [0-9.]+x \|", report.markdown)
    assert control_ratio(report.markdown) > 0


def test_rounds_of_a_closed_loop_pool_their_tokens_time_and_latencies():
    from draftwise.llm.closed_loop import merge_rounds

    first = {"tokens": 30, "seconds": 3.0, "tokens_per_s": 10.0, "latencies": [1.0, 2.0, 9.0], "ttfts": [0.1, 0.2, 0.3],
             "outputs": [[1], [2], [3]]}
    second = {"tokens": 30, "seconds": 2.0, "tokens_per_s": 15.0, "latencies": [3.0, 4.0, 5.0], "ttfts": [0.4, 0.5, 0.6],
              "outputs": [[1], [2], [4]]}
    merged = merge_rounds([first, second])
    assert (merged["tokens"], merged["seconds"], merged["tokens_per_s"]) == (60, 5.0, 12.0)  # not the mean of 10 and 15
    assert merged["p50"] == 3.5 and merged["ttft_p50"] == pytest.approx(0.35) and merged["rounds"] == [10.0, 15.0]
    assert merged["outputs"] == [[1], [2], [3], [1], [2], [4]] and merged["latencies"] == [1.0, 2.0, 3.0, 4.0, 5.0, 9.0]


def test_concurrency_suite_runs_closed_loops_per_level(settings):
    report = run_suite("concurrency", replace(settings, configs=("ngram:k=2",), levels=(1, 2), requests=3))
    points = report.data["points"]
    assert list(points) == ["plain", "ngram:k=2", CONTROL] and all(list(p) == [1, 2] for p in points.values())
    for name, by_level in points.items():
        for level, point in by_level.items():
            assert point["equal_to_plain"] == 3 * LOOP_ROUNDS and len(point["rounds"]) == LOOP_ROUNDS, (name, level)
            assert point["tokens"] > 0 and len(point["latencies"]) == 3 * LOOP_ROUNDS, (name, level)
    assert points["plain"][2]["speedup"] == 1.0
    assert "| ngram:k=2 | 2 |" in report.markdown and control_ratio(report.markdown) > 0
    assert report.plots["throughput and p95 latency vs concurrency"].stat().st_size > 1000


def test_server_load_suite_drives_real_servers(settings):
    pytest.importorskip("openai")
    report = run_suite("server-load", replace(settings, configs=("ngram:k=2",), levels=(2,), requests=3,
                                              serve_arguments=speculative_arguments))
    points = report.data["points"]
    assert list(points) == ["plain", "ngram:k=2", CONTROL]
    for point in points.values():
        assert point[2]["finished"] == 3 and not point[2]["errors"] and point[2]["incomplete"] == 0
        assert point[2]["equal_to_plain"] == 3 and point[2]["tokens"] > 0
    assert f"| {CONTROL} | 2 |" in report.markdown and control_ratio(report.markdown) > 0
    assert (settings.output / "server-1.log").exists()


def test_server_flags_read_back_as_the_config():
    from draftwise.cli import build_parser
    from draftwise.cli.speculative_flags import speculative_from_args

    specs = [parse_config("ngram:k=2", {"ngram": {"prompt_lookup_max": 3}}),
             {**parse_config("draft:k<=4", {"draft": {"model": "m", "draft_vocab_size": None}}),
              "draft_probability": 0.5}]
    for spec in specs:
        args = build_parser().parse_args(["serve", *speculative_arguments(spec)])
        read = speculative_from_args(args)
        assert {name: read.get(name, 1.0) for name in spec} == spec
    assert speculative_arguments(None) == []


def test_plain_and_quantization_suites_measure_formats(settings, monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))  # the tiny model's packed weights
    plain = run_suite("plain", replace(settings, formats=("none", "int8:pytorch"), per_category=1))
    assert list(plain.data["summary"]) == ["none", "int8:pytorch", "none (control)"]
    assert re.search(r"\| int8:pytorch \| [0-9.]+ \| [0-9.]+ \| [0-9.]+x \|", plain.markdown)
    assert re.search(r"\| none \| [0-9.]+ \| 1\.00 \| [0-9.]+ \|", plain.markdown)  # forward over n=1 is 1.00
    assert "as a token tree" in plain.markdown and set(plain.data["measures"]["none"][1]["tree_seconds"]) == {
        1, 2, 4, 8, 16}
    assert control_ratio(plain.markdown) > 0
    quality = run_suite("quantization", replace(settings, formats=("none", "int8:pytorch"), per_category=1,
                                                eval_tokens=48))
    measures = quality.data["measures"]
    assert measures["none"][2]["top1_agreement"] == measures["none (control)"][2]["top1_agreement"] == 1.0
    assert measures["none"][2]["perplexity"] == pytest.approx(measures["none (control)"][2]["perplexity"])
    assert 0 < measures["int8:pytorch"][2]["top1_agreement"] <= 1 and measures["none"][2]["tokens"] == 47
    assert "| int8:pytorch |" in quality.markdown and "int8: " in quality.markdown
    assert control_ratio(quality.markdown) == pytest.approx(
        quality.data["summary"]["none (control)"]["all"]["speedup"], abs=0.006)
    with pytest.raises(InvalidParameterError, match="FORMAT"):
        run_suite("plain", replace(settings, formats=("int3",)))


def test_drafting_options_suite(settings, tiny_qwen, fast_profiles):
    report = run_suite("drafting-options", replace(settings, configs=("draft",), per_category=1,
                                                   options={"draft": {"model": str(tiny_qwen),
                                                                      "draft_vocab_size": 64}}))
    greedy = report.data["greedy"]["summary"]
    assert list(greedy) == ["plain", "draft:k<=4 full head", "draft:k<=4 head 64", "draft:k=4 no stop",
                            "draft:k=4 stop below 0.5", CONTROL]
    assert greedy["draft:k<=4 full head"]["all"]["acceptance_rate"] == 1.0  # the target drafting for itself
    assert report.data["greedy"]["builds"]["draft:k<=4 head 64"]["draft_seconds"][1] > 0
    sampled = report.data["randomized"]["summary"]
    assert list(sampled) == ["plain", "draft:k=2 a=1.0", "draft:k=2 a=0.7", "draft:k=2 a=0.5", CONTROL]
    assert sampled["plain"]["all"]["equal_to_plain"] is None  # sampled: outputs are not compared
    assert report.markdown.count("Control: ") == 2 and "| draft:k=2 a=0.5 |" in report.markdown


def test_cli_writes_the_suite_and_a_benchmarks_section_headed_by_its_command(tiny_qwen, traffic, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    benchmarks = tmp_path / "BENCHMARKS.md"
    benchmarks.write_text("# Benchmarks\n\nolder text\n")
    argv = ["bench", "--suite", "plain", "--model", str(tiny_qwen), "--dataset", str(traffic), "--formats", "none",
            "--per-category", "1", "--max-tokens", "4", "--max-model-len", "512", "--in-process",
            "--output", str(tmp_path / "out"), "--write-benchmarks", str(benchmarks), "--section", "tiny"]
    assert main(argv) == 0
    assert main(argv) == 0  # the section is replaced, not appended twice
    text = benchmarks.read_text()
    assert text.startswith("# Benchmarks\n\nolder text\n") and text.count("<!-- tiny:start -->") == 1
    assert f"<!-- tiny:start -->\nCommand: `draftwise bench --suite plain --model {tiny_qwen} " in text
    assert "| none (control) |" in text
    saved = json.loads((tmp_path / "out" / "plain.json").read_text())
    assert set(saved["summary"]) == {"none", "none (control)"} and saved["settings"]["formats"] == ["none"]
    assert (tmp_path / "out" / "plain.md").read_text().startswith(f"{tiny_qwen}: plain decoding")
    assert math.isfinite(saved["summary"]["none (control)"]["all"]["speedup"])


def test_spec_bench_mt_bench_prompts_cover_its_subcategories(tmp_path, monkeypatch, tiny_qwen):
    """The file holds MT-bench in blocks of ten per subcategory; 3 MT-bench prompts must not be 3 writing ones."""
    rows = [{"category": c, "turns": [f"{c} {i}"]} for c in ("writing", "roleplay", "reasoning") for i in range(3)]
    rows += [{"category": "qa", "turns": [f"qa {i}"]} for i in range(3)]
    (tmp_path / "spec_bench_question.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    monkeypatch.setenv("DRAFTWISE_DATA", str(tmp_path))
    chosen = load_prompts("spec-bench", Tokenizer(tiny_qwen), per_category=4)
    assert [c for c, _ in chosen] == ["mt_bench"] * 4 + ["qa"] * 3
    mt_bench = [prompt for category, prompt in chosen if category == "mt_bench"]
    for expected, prompt in zip(["writing 0", "roleplay 0", "reasoning 0", "writing 1"], mt_bench):
        assert expected in prompt


def test_abuse_suite_holds_ordinary_streams_beside_a_hostile_burst(settings):
    pytest.importorskip("openai")
    report = run_suite("abuse", replace(settings, configs=("ngram:k=2",), levels=(4,), requests=4, hostile=80,
                                        max_tokens=12, serve_arguments=speculative_arguments))
    quiet, abused = report.data["quiet"], report.data["abused"]
    assert quiet["finished"] == abused["finished"] == 4 and not abused["errors"] and abused["incomplete"] == 0
    hostile = abused["side"]["hostile"]
    assert hostile["sent"] == 80 and hostile["answered_right"] == 80, hostile["wrong"]
    assert hostile["health_probes"] > 0 and hostile["health_not_200"] == 0
    assert "| ordinary texts equal to the quiet phase's | 4/4 |" in report.markdown
    assert "| hostile requests answered wrongly | 0 |" in report.markdown


def test_gpu_suite_on_the_cpu(tmp_path, tiny_qwen):
    """The device suite runs on any device: here the CPU, the static step (mode eager) against the
    eager path and its control; self-drafting accepts everything and equals plain at 1, 8 and 32
    rows; cost models land where `draftwise plan --costs` reads them."""
    from draftwise.speculative.control.cost_model import CostModel

    settings = BenchSettings(output=tmp_path / "out", model=str(tiny_qwen), levels=(1, 4), step_mode="eager",
                             reference=tmp_path / "graph_step.py", progress=False)
    report = run_suite("gpu", settings)
    data = report.data
    assert data["step_mode"] == "eager" and set(data["step_seconds"]) == {1, 4}
    assert set(data["verify_seconds"]) == {1, 2, 4, 8, 16, 32, 64}
    assert all(set(s) == {"step", "eager", "eager (control)"} for s in data["step_seconds"].values())
    for rows, result in data["self_drafting"].items():
        assert result["acceptance"] == 1.0 and result["equal"] == result["requests"] == rows and result["drafted"]
    from draftwise.speculative.registry import all_specs

    cheap = {spec.name for spec in all_specs() if spec.per_request and spec.benchmark_by_default}
    assert "ngram" in cheap and set(data["costs"]) == {"plain"} | cheap
    assert all(CostModel.read(Path(path)) is not None for path in data["costs"].values())
    assert "the reference step needs CUDA" in report.markdown and "not run (--peers hf)" in report.markdown
    assert "Control: `eager (control)`" in report.markdown


@pytest.fixture
def structured_data(tmp_path, monkeypatch):
    """Small stand-ins of the shared data files the structured workload reads."""
    import gzip

    with gzip.open(tmp_path / "humaneval.jsonl.gz", "wt") as out:
        for i in range(3):
            out.write(json.dumps({"prompt": f"def f{i}(a, b):\n    \"\"\"Add.\n    >>> f{i}(1, 2)\n    3\n    \"\"\"\n"})
                      + "\n")
    rows = [{"category": "qa", "turns": [f"Who wrote book {i}?"]} for i in range(3)]
    rows += [{"category": "summarization", "turns": [f"Article {i}: the council met on Monday."]} for i in range(3)]
    (tmp_path / "spec_bench_question.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    monkeypatch.setenv("DRAFTWISE_DATA", str(tmp_path))


def test_structured_suite_compares_constrained_configs_at_batch_1_and_8(settings, tiny_tools, structured_data,
                                                                          fast_profiles):
    pytest.importorskip("jsonschema")
    report = run_suite("structured", replace(settings, model=str(tiny_tools), per_category=1, max_tokens=48,
                                             max_model_len=2048, configs=("draft:k=3", "draft:k=3:forced_drafts=false"),
                                             options={"draft": {"model": str(tiny_tools), "draft_context_window": 2048}}))
    summary = report.data["summary"]  # (the draft model reads the whole context: it drafts what the target writes)
    assert list(summary) == ["plain", "draft:k=3", "draft:k=3:forced_drafts=false", CONTROL]
    for name in summary:
        assert summary[name]["all"]["equal_to_plain"] == 4  # the target drafting for itself changes nothing
        assert report.data["valid"][name] == report.data["valid"]["plain"]
    forced, unforced = summary["draft:k=3"]["all"], summary["draft:k=3:forced_drafts=false"]["all"]
    assert forced["acceptance_rate"] == unforced["acceptance_rate"] == 1.0
    measures = report.data["measures"]["draft:k=3"]
    assert measures[-1]["constrained_steps"] > 0 and measures[-1]["grammar_seconds"] > 0
    for kind in ("extraction", "classification", "tool_call", "summary_card", "Batch 8"):
        assert kind in report.markdown


def test_grammar_engines_suite_measures_llguidance_against_its_control(settings):
    report = run_suite("grammar-engines", settings)
    coverage = report.data["coverage"]["llguidance"]
    assert coverage["enum"] == coverage["pattern"] == coverage["recursive $ref"] == "enforced"
    assert coverage["uniqueItems"] == coverage["not"] == "refused"  # never loosened
    assert "llguidance (control)" in report.data["mask_seconds"] and "| llguidance |" in report.markdown


def test_prefix_cache_suite_times_first_tokens_with_caching_off_and_on(settings, structured_data):
    report = run_suite("prefix-cache", replace(settings, per_category=3, max_tokens=4, max_model_len=512))
    figures = report.data["figures"]
    assert list(figures) == ["caching off", "caching on", "caching off (control)"]
    assert figures["caching on"]["hit_share"] > 0.5 and figures["caching off"]["hit_share"] == 0
    assert all(f["equal"] == 3 for f in figures.values())


def test_prefill_suite_times_prompts_with_the_prompt_kernels_off_and_on(settings, structured_data):
    report = run_suite("prefill", replace(settings, per_category=1, max_tokens=2, max_model_len=512, eval_tokens=200))
    figures = report.data["figures"]
    assert report.data["lengths"] == ["150 tokens", "400 tokens"]  # (800 and 1,600 do not fit 512)
    assert list(figures) == ["prompt kernels off", "prompt kernels on", "prompt kernels off (control)"]
    assert figures["prompt kernels off"]["vs_baseline"] == {"150 tokens": 1.0, "400 tokens": 1.0}
    assert all(speed > 0 for f in figures.values() for speed in f["prefill_tokens_per_second"].values())
    on, off = figures["prompt kernels on"], figures["prompt kernels off"]
    if amx_kernels() is None:  # both configs compute alike
        assert on["equal"] == 2 and on["top1_as_baseline"] == 1.0 and on["perplexity"] == off["perplexity"]
    else:  # the tiny int4 model's prompts on AMX tiles: rounded otherwise, the same model (a random one: flat logits)
        assert on["top1_as_baseline"] >= 0.75 and abs(on["perplexity"] / off["perplexity"] - 1) < 0.05
    assert on["perplexity"] > 1
    assert "| prompt kernels on |" in report.markdown and "AMX tiles on this machine" in report.markdown


def test_processors_suite_compares_speculation_with_penalties_and_logprobs(settings, structured_data, fast_profiles):
    report = run_suite("processors", replace(settings, datasets=("humaneval",), per_category=2, max_tokens=8,
                                             configs=("draft:k=3",)))
    summary = report.data["summary"]
    assert list(summary) == ["plain", "draft:k=3", CONTROL]
    assert summary["draft:k=3"]["penalties"]["equal_to_plain"] == 2
    assert summary["draft:k=3"]["penalties"]["acceptance_rate"] == 1.0  # the target drafting for itself
    assert all(gap < 1e-4 for gap in report.data["logprob_differences"].values())


def test_the_hf_peer_runs_the_prompt_ids_draftwise_runs():
    """A transformers tokenizer puts its BOS first even before a chat template's own (two BOS: the
    peer would run another prompt); the peer takes the text as written, BOS added only where missing."""
    from draftwise.benchmark.peers import peer_prompt_ids

    class LlamaLike:  # (a tokenizer that adds a BOS, id 1, written "<s>")
        bos_token_id, add_bos_token = 1, True

        def __call__(self, text, add_special_tokens=True):
            ids = [1] if text.startswith("<s>") else []
            ids += [ord(c) for c in text.removeprefix("<s>")]
            return {"input_ids": ([1] if add_special_tokens else []) + ids}

    assert peer_prompt_ids(LlamaLike(), "<s>hi") == [1, ord("h"), ord("i")]
    assert peer_prompt_ids(LlamaLike(), "hi") == [1, ord("h"), ord("i")]
    LlamaLike.add_bos_token = False
    assert peer_prompt_ids(LlamaLike(), "hi") == [ord("h"), ord("i")]


def test_a_prefill_run_whose_context_holds_no_length_is_refused_up_front(settings, structured_data):
    with pytest.raises(InvalidParameterError, match="holds none of the prompt lengths"):
        run_suite("prefill", replace(settings, max_model_len=64))
