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
        (("generate", "--model", str(tiny_qwen), "--temperature", "-1", "x"), "temperature must be a finite number >= 0"),
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


def test_serve_answers_the_openai_client_and_shuts_down_on_ctrl_c(tiny_qwen):
    import signal
    import socket
    import time

    import httpx
    import openai

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "draftwise", "serve", "--model", str(tiny_qwen), "--method",
                               "ngram", "--port", str(port), "--served-model-name", "tiny", "--max-model-len", "256"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert server.poll() is None, server.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"
    finally:
        server.send_signal(signal.SIGINT)
        _, stderr = server.communicate(timeout=60)
    assert server.returncode == 0 and "Traceback" not in stderr, stderr


def test_building_the_parser_imports_no_server_packages():
    """Every subcommand's flags are built without the server's packages (pydantic, FastAPI,
    uvicorn): `draftwise bench` on a machine that has only torch and the engine's own needs (a GPU
    machine that can fetch nothing) must not need them."""
    check = ("import sys; from draftwise.cli import build_parser; build_parser(); "
             "print(sorted(m for m in ('pydantic', 'fastapi', 'uvicorn', 'starlette') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr[-2000:]


def test_speculation_flags_without_a_method_are_refused_not_ignored():
    from draftwise.cli import build_parser
    from draftwise.cli.speculative_flags import speculative_from_args
    from draftwise.errors import InvalidParameterError

    for flags, named in ((["-k", "3"], "-k"), (["--fixed-k"], "--fixed-k"), (["--draft-probability", "0.5"],
                                                                              "--draft-probability")):
        args = build_parser().parse_args(["generate", "x", *flags])
        try:
            speculative_from_args(args)
        except InvalidParameterError as error:
            assert named in str(error) and "need --method" in str(error)
        else:
            raise AssertionError(f"{flags} without --method was accepted")
    plain = build_parser().parse_args(["generate", "x"])
    assert speculative_from_args(plain) is None
    spec = speculative_from_args(build_parser().parse_args(["generate", "x", "--method", "ngram"]))
    assert spec["num_speculative_tokens"] == 5 and spec["draft_probability"] == 1.0 and spec["adaptive"]


def test_a_true_or_false_option_reads_its_words():
    from draftwise.cli import build_parser
    from draftwise.cli.speculative_flags import speculative_from_args

    def cross(word):
        args = build_parser().parse_args(["generate", "x", "--method", "draft", "--cross-tokenizer", word])
        return speculative_from_args(args)["cross_tokenizer"]

    assert cross("false") is False and cross("0") is False and cross("true") is True and cross("True") is True
    result = run("generate", "x", "--method", "draft", "--cross-tokenizer", "maybe")
    assert result.returncode == 2 and "expected true or false, got 'maybe'" in result.stderr


def test_a_broken_model_folder_is_named_without_traceback(tiny_qwen, tmp_path):
    import json
    import shutil

    cases = {}
    for name, (file, text) in {
        "tokenizer": ("tokenizer.json", '{"model": 3}'),
        "tokenizer-config": ("tokenizer_config.json", "{not json"),
        "config": ("config.json", None),
    }.items():
        folder = tmp_path / name
        shutil.copytree(tiny_qwen, folder)
        if text is None:  # a config that disagrees with the weights
            config = json.loads((folder / file).read_text())
            text = json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2})
        (folder / file).write_text(text)
        cases[name] = folder
    expected = {"tokenizer": "tokenizer.json: not a readable tokenizer",
                "tokenizer-config": "tokenizer_config.json: unreadable",
                "config": "config.json disagrees with the weights"}
    for name, folder in cases.items():
        result = run("generate", "--model", str(folder), "--max-tokens", "2", "--quantization", "none", "x")
        assert result.returncode == 2, (name, result.stderr)
        assert expected[name] in result.stderr and "Traceback" not in result.stderr, result.stderr
    import torch

    if not torch.cuda.is_available():
        result = run("generate", "--model", str(tiny_qwen), "--device", "cuda", "x")
        assert result.returncode == 2 and "no CUDA GPU here" in result.stderr and "Traceback" not in result.stderr
