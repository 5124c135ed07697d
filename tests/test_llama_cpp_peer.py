"""The llama.cpp peer of `--suite kernels`: its tools' outputs read right, its configs interleaved
with draftwise's, and a clear "not run" row where it cannot be built. The tools here are stand-ins
printing what llama.cpp's print (building llama.cpp takes minutes: the benchmark does it, once)."""

import json
import sys
from dataclasses import replace

import pytest

from draftwise.benchmark.llama_cpp import LlamaCppFailed, parse_speculative_simple
from draftwise.benchmark.suites import BenchSettings, run_suite
from draftwise.cli import main
from draftwise.paths import CACHE_ENV

SPECULATIVE_OUTPUT = """
encoded   41 tokens in    0.512 seconds, speed:   80.078 t/s
decoded   64 tokens in    2.250 seconds, speed:   28.444 t/s

n_draft   = 16
n_predict = 64
n_drafted = 80
n_accept  = 52
accept    = 65.000%
"""

FAKE_BENCH = """#!{python}
import json, sys
args = sys.argv[1:]
value = lambda flag: args[args.index(flag) + 1]
prompt, generated = (int(x) for x in value("-pg").split(",")) if "-pg" in args else (int(value("-p")), 0)
repetitions = int(value("-r"))
seconds = 0.001 * prompt + 0.01 * generated + 0.005  # a pass: 5 ms and 1 ms a token; a decoded token: 10 ms
print(json.dumps([{{"n_prompt": prompt, "n_gen": generated, "samples_ns": [int(seconds * 1e9)] * repetitions}}]))
"""

FAKE_SPECULATIVE = """#!{python}
import sys
args = sys.argv[1:]
assert "-md" in args and "--temp" in args
n = int(args[args.index("-n") + 1])
print("some text", flush=True)
print("encoded   12 tokens in    0.050 seconds, speed:   240.000 t/s", file=sys.stderr)
print(f"decoded   {{n}} tokens in    0.040 seconds, speed:   200.000 t/s", file=sys.stderr)
"""


def test_speculative_simple_output_is_read():
    found = parse_speculative_simple(SPECULATIVE_OUTPUT)
    assert found == {"encoded": 41, "encode_seconds": 0.512, "decoded": 64, "decode_seconds": 2.25}
    with pytest.raises(LlamaCppFailed, match="decode line"):
        parse_speculative_simple(SPECULATIVE_OUTPUT.replace("decoded", "done"))


@pytest.fixture
def fake_llama_cpp(monkeypatch, gguf_cache):
    from draftwise.benchmark.llama_cpp_build import build_folder

    monkeypatch.setenv(CACHE_ENV, str(gguf_cache))
    folder = build_folder() / "bin"
    folder.mkdir(parents=True, exist_ok=True)
    for name, script in (("llama-bench", FAKE_BENCH), ("llama-speculative-simple", FAKE_SPECULATIVE)):
        (folder / name).write_text(script.format(python=sys.executable))
        (folder / name).chmod(0o755)
    return folder


@pytest.fixture
def settings(tmp_path, tiny_qwen_gguf, gguf_cache, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(gguf_cache))
    traffic = tmp_path / "prompts.jsonl"
    traffic.write_text("\n".join(json.dumps({"prompt": p, "category": "code"})
                                 for p in ("def add(a, b):", "for i in range(3):")))
    return BenchSettings(output=tmp_path / "out", model=str(tiny_qwen_gguf), datasets=(str(traffic),),
                         max_tokens=6, isolation="in-process", max_model_len=512, progress=False,
                         configs=("draft:k=2",), options={"draft": {"model": str(tiny_qwen_gguf)}})


def test_kernels_suite_sets_draftwise_beside_llama_cpp(settings, fake_llama_cpp):
    report = run_suite("kernels", replace(settings, peers=("llama.cpp",)))
    summary = report.data["summary"]
    assert set(summary) == {"plain", "draft:k=2", "plain (control)", "llama.cpp plain", "llama.cpp draft"}
    # llama-bench's seconds per request: a 6-token generation after the prompt, by the stand-in's formula
    prompts = [r["prompt_tokens"] for r in report.data["requests"]["llama.cpp plain"]]
    assert summary["llama.cpp plain"]["all"]["seconds"] == pytest.approx(sum(0.001 * p + 0.065 for p in prompts))
    assert summary["llama.cpp draft"]["all"]["seconds"] == pytest.approx(2 * 0.09)
    assert summary["llama.cpp draft"]["all"]["equal_to_plain"] is None  # llama.cpp's tokens are not compared
    assert summary["draft:k=2"]["all"]["equal_to_plain"] == 2
    # forward passes: llama.cpp's from llama-bench -p n -d 256, relative to n = 1
    peer_passes = report.data["measures"]["llama.cpp plain"][0]["seconds"]
    assert peer_passes == {n: pytest.approx(0.005 + 0.001 * n) for n in (1, 2, 4, 8, 16)}
    assert report.data["measures"]["plain"][1]["rss_bytes"] > report.data["measures"]["plain"][1]["weights_bytes"] > 0
    text = report.markdown
    assert "| llama.cpp draft |" in text and "vs llama.cpp plain" in text and "RSS / GGUF" in text
    assert "| llama.cpp plain | 6.0 | 1.00 | 1.17 | 1.50 | 2.17 | 3.50 |" in text  # n=1 in ms, then relative


def test_kernels_suite_says_why_llama_cpp_did_not_run(settings, monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "empty-cache"))  # no binaries built
    monkeypatch.setenv("PATH", str(tmp_path))  # and no cmake to build them
    report = run_suite("kernels", replace(settings, peers=("llama.cpp",), configs=()))
    assert "| llama.cpp plain / draft | not run (building llama.cpp needs cmake" in report.markdown
    assert "llama.cpp plain" not in report.data["summary"]


def test_llama_cpp_peer_belongs_to_the_kernels_suite(capsys):
    assert main(["bench", "--suite", "speculative", "--peers", "llama.cpp"]) != 0
    assert "--peers llama.cpp runs beside the kernels suite" in capsys.readouterr().err


def test_on_amx_cpus_llama_cpp_runs_without_repacking_and_a_signal_is_named(monkeypatch):
    """The pinned llama.cpp's AMX path dies with SIGILL in prompt processing: on CPUs with AMX its
    tools run with repacking off; a tool killed by a signal is reported by the signal's name."""
    import subprocess
    from pathlib import Path

    from draftwise.benchmark import llama_cpp

    commands, results = [], []
    monkeypatch.setattr(llama_cpp.subprocess, "run", lambda command, **_: (commands.append(command), results.pop(0))[1])
    bench_output = json.dumps([{"samples_ns": [10**9]}])
    for repack in (True, False):
        config = llama_cpp.LlamaCppConfig("llama.cpp plain", {"llama-bench": Path("llama-bench"),
                                                              "llama-speculative-simple": Path("llama-speculative-simple")},
                                          Path("t.gguf"), Path("d.gguf"), None, 8, 2, repack=repack)
        results[:] = [subprocess.CompletedProcess([], 0, bench_output, ""),
                      subprocess.CompletedProcess([], 0, "", SPECULATIVE_OUTPUT)]
        assert config.forward_pass_seconds((4,), 16, 1) == {4: 1.0}
        config._speculate("def f():")
        bench, speculate = commands[-2:]
        assert ("--repack" in bench and bench[bench.index("--repack") + 1] == "0") is not repack
        assert ("--no-repack" in speculate) is not repack
    results[:] = [subprocess.CompletedProcess([], -4, "", "")]
    with pytest.raises(LlamaCppFailed, match="llama-bench was killed by SIGILL"):
        config.forward_pass_seconds((4,), 16, 1)
    from draftwise.errors import DraftwiseError
    assert issubclass(LlamaCppFailed, DraftwiseError)  # passed through the benchmark worker; one line from the CLI
