"""The command line, run as a user would run it."""

import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-m", "draftwise", *args], capture_output=True, text=True, timeout=300)


def test_generate_streams_text_and_prints_stats(tiny_qwen):
    result = run("generate", "--model", str(tiny_qwen), "--max-tokens", "8", "def add(a, b):")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def add(a, b):") and len(result.stdout) > len("def add(a, b):\n")
    assert "8 tokens in" in result.stderr and "finish: length" in result.stderr


def test_errors_are_one_line_without_traceback(tiny_qwen, tmp_path):
    cases = [
        (("generate", "--model", "no-such-model", "x"), "unknown model 'no-such-model'"),
        (("generate", "--model", str(tmp_path / "missing.gguf"), "x"), "unknown model"),
        (("generate", "--model", str(tiny_qwen), "--max-tokens", "0", "x"), "max_tokens must be a positive"),
        (("generate", "--model", str(tiny_qwen), "--temperature", "-1", "x"), "temperature must be >= 0"),
        (("generate", "--model", str(tiny_qwen), ""), "prompt is empty"),
    ]
    for args, message in cases:
        result = run(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_models_lists_the_defaults():
    result = run("models")
    assert result.returncode == 0
    assert "qwen2.5-coder-1.5b" in result.stdout and "[default target]" in result.stdout
    assert "qwen2.5-coder-0.5b" in result.stdout and "[default draft]" in result.stdout
