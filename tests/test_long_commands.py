"""The long commands (plan, bench, divergence) refuse what they cannot honour before the work begins,
name bad input files, and never ignore a flag in silence."""

import json

import pytest

from draftwise.cli import main
from draftwise.errors import InvalidParameterError
from draftwise.planner.plan import PlanOptions, drafter_footprint, recommend
from draftwise.traffic import read_traffic


class Characters:
    """A tokenizer stand-in for traffic files (its chat template joins the contents)."""

    def apply_chat_template(self, messages):
        return " | ".join(m["content"] for m in messages)


def traffic(tmp_path, content: bytes, name: str = "traffic.jsonl"):
    path = tmp_path / name
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("content, name, message", [
    (b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n', "t.jsonl", ":2: not UTF-8 text"),
    (b'not gzip at all', "t.jsonl.gz", "unreadable"),
    (b'{"messages": ["hi"]}\n', "t.jsonl", ":1: \"messages\" must be a non-empty list"),
    (b'{"messages": [{"role": "user"}]}\n', "t.jsonl", ":1: \"messages\" must be"),
    (b'{"prompt": "a"}\n{"prompt": " "}\n', "t.jsonl", ":2: the prompt is empty"),
])
def test_a_bad_traffic_file_is_named_with_its_line(tmp_path, content, name, message):
    with pytest.raises(InvalidParameterError, match=message):
        read_traffic(traffic(tmp_path, content, name), Characters(), sample=4, max_tokens=8)


def test_a_good_traffic_file_still_reads(tmp_path):
    rows = [{"prompt": "a"}, {"messages": [{"role": "user", "content": "b"}], "segment": "chat"}]
    path = traffic(tmp_path, "\n".join(json.dumps(r) for r in rows).encode())
    assert sorted(item.prompt for item in read_traffic(path, Characters(), sample=4, max_tokens=8)) == ["a", "b"]


@pytest.mark.parametrize("fields, message", [
    (dict(price_per_mtok=3.0), "go together"),
    (dict(tokens_per_day=1e6), "go together"),
    (dict(price_per_mtok=-1.0, tokens_per_day=1e6), "must be positive"),
    (dict(max_k=65), "--max-k must be from 1 to 64"),
    (dict(validate=True, concurrency=(8, 16)), "none of \\[8, 16\\] is"),
    (dict(threads_per_replica=2), "--threads-per-replica needs --replicas"),
])
def test_plan_options_that_would_be_ignored_or_fail_late_are_refused(fields, message):
    with pytest.raises(InvalidParameterError, match=message):
        PlanOptions("traffic.jsonl", drafters=("ngram",), **fields)


def point(tokens_per_second: float) -> dict:
    return {"tokens_per_second": tokens_per_second, "latency_p95": 1.0}


def test_speculation_is_switched_off_only_where_it_pays_at_no_higher_level():
    predictions = {"plain": [point(100), point(300), point(500)], "ngram": [point(101), point(330), point(480)]}
    best, switch_off = recommend(predictions, (1, 4, 16))
    assert [best[c]["config"] for c in (1, 4, 16)] == ["plain", "ngram", "plain"]
    assert switch_off == 16  # (from 1 on, said before, while it pays at 4)
    assert recommend({"plain": [point(100)], "ngram": [point(150)]}, (1,))[1] is None


def test_predictions_within_the_margin_go_to_the_config_adding_least_memory_adaptive_first():
    # the twenty-seventh session's validation at concurrency 1: draft k=2 predicted 15.10 tok/s,
    # prompt lookup adaptive 15.08 (0.1% apart), measured 15.47 and 15.55
    predictions = {"plain": [point(13.55), point(17.33)],
                   "draft adaptive k<=6": [point(15.00), point(17.87)], "draft k=2": [point(15.10), point(17.0)],
                   "ngram adaptive k<=6": [point(15.08), point(18.17)], "ngram k=2": [point(14.0), point(18.19)]}
    footprint = drafter_footprint({"draft": (326 << 20, 24 << 10), "ngram": (0, 0)})
    best, _ = recommend(predictions, (1, 2), footprint)
    assert best[1]["config"] == "ngram adaptive k<=6"  # not the 0.1% faster draft k=2
    assert best[1]["tied"] == ["draft adaptive k<=6", "draft k=2", "ngram adaptive k<=6"]
    assert best[2]["config"] == "ngram adaptive k<=6"  # not the 0.1% faster fixed k
    assert best[1]["speedup"] == pytest.approx(15.08 / 13.55)
    # beyond the margin the fastest wins whatever it holds
    predictions["draft k=2"][0] = point(15.6)
    assert recommend(predictions, (1, 2), footprint)[0][1]["config"] == "draft k=2"
    # an entry with options is matched whole, not by its method's prefix
    wide = drafter_footprint({"draft": (1, 0), "draft:model=smollm2-135m": (5, 0)})
    assert wide("draft:model=smollm2-135m k=3") == (5, 0) and wide("draft adaptive k<=6") == (1, 0)


def test_the_report_names_the_ties_and_whether_the_fastest_measured_was_among_them():
    from draftwise.planner.plan import Plan
    from draftwise.planner.report import render

    predictions = {"plain": [point(10.0)], "draft k=2": [point(12.1)], "ngram adaptive k<=6": [point(12.0)]}
    best, switch_off = recommend(predictions, (1,), drafter_footprint({"draft": (1 << 20, 0), "ngram": (0, 0)}))
    row = {"concurrency": 1, "rounds": 1, "measured_tokens_per_second": 12.5, "predicted_tokens_per_second": 12.1,
           "error": 0.0, "measured_speedup": 1.25, "predicted_speedup": 1.21, "speedup_error": 0.0,
           "measured_latency_p95": 1.0, "predicted_latency_p95": 1.0}
    plan = Plan({"traffic": "t.jsonl", "concurrency": (1,)}, 8, {"code": 8}, predictions, best, switch_off, [], {}, None,
                validation=[{**row, "config": "plain", "measured_speedup": 1.0},
                            {**row, "config": "ngram adaptive k<=6", "measured_speedup": 1.1},
                            {**row, "config": "draft k=2"}])
    text = render(plan)
    assert "| 1 | 10.0 | 1.0 | ngram adaptive k<=6 | 12.0 | 1.20x |" in text
    assert "not told apart: draft k=2, ngram adaptive k<=6; recommended the one adding the least memory" in text
    assert "recommended ngram adaptive k<=6; measured fastest draft k=2 (one of the 2 predicted within 2%)." in text


def test_an_unusable_output_is_refused_before_any_model_loads(tmp_path, capsys):
    taken = tmp_path / "a-file"
    taken.write_text("x")
    assert main(["plan", "--traffic", str(tmp_path / "none.jsonl"), "--output", str(taken)]) == 2
    assert "--output" in capsys.readouterr().err
    assert main(["bench", "--model", "no-such-model", "--output", str(taken)]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err
    assert main(["bench", "--model", "no-such-model", "--output", str(tmp_path / "out"),
                 "--write-benchmarks", str(tmp_path)]) == 2
    assert "is a folder, not a file" in capsys.readouterr().err


def test_from_plan_refuses_the_flags_it_would_ignore(tmp_path, capsys):
    assert main(["plan", "--from-plan", str(tmp_path / "plan.json"), "--costs", str(tmp_path), "--max-k", "2",
                 "--sample", "3"]) == 2
    error = capsys.readouterr().err
    assert "--max-k, --sample do not apply" in error


def test_divergence_takes_a_few_tokens(tiny_qwen, capsys):
    assert main(["divergence", "--model", str(tiny_qwen), "--quantization", "none", "--tokens", "3",
                 "--window", "2"]) == 0
    assert "bit-identical: 3 tokens" in capsys.readouterr().out


@pytest.mark.parametrize("argv, flags", [
    (["--suite", "concurrency", "--temperature", "0.7"], "--temperature"),
    (["--suite", "prefill", "--dataset", "humaneval", "--seed", "3"], "--dataset, --seed"),
    (["--suite", "plain", "--draft", "qwen2.5-coder-0.5b"], "--draft"),
    (["--suite", "grammar-engines", "--in-process"], "--in-process"),
])
def test_bench_refuses_a_flag_its_suite_does_not_read(tmp_path, capsys, argv, flags):
    assert main(["bench", "--model", "no-such-model", "--output", str(tmp_path / "out"), *argv]) == 2
    assert f"{flags}: not read by the" in capsys.readouterr().err


def test_bench_takes_the_flags_its_suite_reads(tmp_path, capsys):
    # (the model is then looked for: the flags passed the check)
    assert main(["bench", "--model", "no-such-model", "--output", str(tmp_path / "out"), "--suite", "speculative",
                 "--temperature", "0.7", "--dataset", "humaneval", "--in-process", "--draft", "x"]) != 0
    assert "not read by" not in capsys.readouterr().err


def test_bench_refuses_a_dataset_line_with_its_own_max_tokens(tmp_path):
    from draftwise.benchmark.datasets import load_prompts

    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text(json.dumps({"prompt": "a", "segment": "x"}) + "\n"
                       + json.dumps({"prompt": "b", "segment": "x", "max_tokens": 7}) + "\n")
    with pytest.raises(InvalidParameterError, match="a line sets max_tokens 7, which the bench does not read"):
        load_prompts(str(traffic), Characters(), per_category=4, max_tokens=64)
    traffic.write_text(json.dumps({"prompt": "a", "segment": "x"}) + "\n")
    assert load_prompts(str(traffic), Characters(), per_category=4, max_tokens=64) == [("x", "a")]


@pytest.mark.parametrize("argv, message", [
    (["divergence", "--text", ""], "--text is empty"),
    (["divergence", "--window", "100"], "--window 100 is more than the 48 tokens fed"),
    (["divergence", "--tokens", "100000"], "--tokens 100000 is more than this model's"),
    (["profile", "--live", "-5"], "--live must be a number of tokens >= 0"),
    (["profile", "--method", "ngram", "--fixed-k"], "--fixed-k: not read by profile"),
    (["generate", "--method", "ngram", "--draft-probability", "0.5", "hi"], "--draft-probability applies to sampled"),
    (["train-head", "--kind", "medusa", "--data", "{folder}", "--head-width", "7"], "--head-width: not read when"),
    (["train-head", "--kind", "medusa", "--data", "{folder}"], "a folder, not a JSONL file"),
    (["train-head", "--kind", "medusa", "--data", "{folder}", "--sample", "0"], "sample and max_tokens must be positive"),
    (["train-head", "--kind", "medusa", "--data", "{folder}", "--epochs", "0"], "epochs must be a positive integer"),
])
def test_command_flags_that_would_change_nothing_or_fail_late_are_refused_up_front(tiny_qwen, tmp_path, capsys,
                                                                                   argv, message):
    argv = [a.replace("{folder}", str(tmp_path)) for a in argv]
    model = ["--target" if argv[0] == "train-head" else "--model", str(tiny_qwen)]
    out = ["--out", str(tmp_path / "head")] if argv[0] == "train-head" else []
    assert main([argv[0], *model, *argv[1:], *out]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "head").exists()  # (nothing left behind)


def test_a_closed_pipe_ends_a_command_quietly(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(f"{sys.executable} -m draftwise models | head -c 10", shell=True, capture_output=True,
                          text=True, timeout=120)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr


def test_a_cache_that_is_a_file_is_named(tmp_path, monkeypatch, capsys):
    taken = tmp_path / "a-file"
    taken.write_text("x")
    monkeypatch.setenv("DRAFTWISE_CACHE", str(taken))
    assert main(["models"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
