"""`--chat-template` (vLLM's flag) for `draftwise serve` and `draftwise generate`: a file's path or the
template on one line, read as vLLM reads it; every chat rendered by it; bad values refused by name."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from draftwise.cli import build_parser, main  # noqa: E402
from draftwise.cli.serve import build_server  # noqa: E402
from draftwise.errors import ChatTemplateError, InvalidParameterError  # noqa: E402
from draftwise.text.chat_template import read_chat_template  # noqa: E402
from tests.live_server import LiveServer  # noqa: E402

TEMPLATE = ("{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>> {% endif %}")


def test_a_path_is_read_and_a_one_line_template_has_its_escapes_read(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE
    one_line = TEMPLATE.replace("\n", "\\n")
    assert "\n" not in one_line and read_chat_template(one_line) == TEMPLATE
    assert read_chat_template("{{ 'é ✓' }}") == "{{ 'é ✓' }}"  # (characters beyond ASCII kept as they are)


@pytest.mark.parametrize("value, message", [
    ("no/such/template.jinja", "looks like a file's path, but it cannot be read"),
    ("   ", "looks like a file's path"),
    ("{{ x }}\\x", "a bad escape"),
])
def test_bad_values_are_refused_by_name(value, message):
    with pytest.raises(InvalidParameterError, match=message) as error:
        read_chat_template(value)
    assert "--chat-template" in str(error.value)


def test_an_empty_file_and_a_binary_file_are_refused(tmp_path):
    (tmp_path / "empty.jinja").write_text("\n")
    (tmp_path / "binary.jinja").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(InvalidParameterError, match="the template is empty"):
        read_chat_template(str(tmp_path / "empty.jinja"))
    with pytest.raises(InvalidParameterError, match="not a UTF-8 text file"):
        read_chat_template(str(tmp_path / "binary.jinja"))


def _serve_args(model, *flags):
    return build_parser().parse_args(["serve", "--model", str(model), "--max-model-len", "128", *flags])


def test_the_server_renders_every_chat_with_the_template_given(tiny_qwen, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    _, engine = build_server(_serve_args(tiny_qwen, "--chat-template", str(path)), announce=False)
    engine.shutdown()
    llm = engine.llm
    messages = [{"role": "user", "content": "hello there"}]
    rendered = "<<user>> hello there\n<<assistant>> "
    assert llm.tokenizer.apply_chat_template(messages) == rendered
    server = LiveServer(llm, "m")
    try:
        response = server.client().chat.completions.create(model="m", messages=messages, max_tokens=2,
                                                            temperature=0)
    finally:
        server.stop()
    assert response.usage.prompt_tokens == len(llm.tokenizer.encode(rendered))
    default = build_server(_serve_args(tiny_qwen), announce=False)[1]
    default.shutdown()
    assert default.llm.tokenizer.apply_chat_template(messages) != rendered  # (the model's own, without the flag)


def test_a_template_that_does_not_parse_stops_the_server_before_it_serves(tiny_qwen):
    with pytest.raises(ChatTemplateError, match=r"--chat-template does not parse \(line 1\)"):
        build_server(_serve_args(tiny_qwen, "--chat-template", "{% for m in messages %}"), announce=False)


def test_the_commands_say_what_is_wrong_without_a_traceback(tiny_qwen, capsys):
    assert main(["serve", "--model", str(tiny_qwen), "--chat-template", "missing.jinja"]) != 0
    assert "missing.jinja' looks like a file's path" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", str(tiny_qwen), "--chat-template", "{{ x }}"]) != 0
    err = capsys.readouterr().err
    assert "--chat-template renders chats: give --chat too" in err and "Traceback" not in err


def test_generate_renders_its_prompt_with_the_template_given(tiny_qwen, capsys, monkeypatch):
    from draftwise.llm import LLM

    prompts, stream = [], LLM.stream
    monkeypatch.setattr(LLM, "stream", lambda self, prompt, *rest, **keywords: (
        prompts.append(prompt), stream(self, prompt, *rest, **keywords))[1])
    assert main(["generate", "hi", "--model", str(tiny_qwen), "--chat", "--chat-template",
                 TEMPLATE.replace("\n", "\\n"), "--max-tokens", "1"]) == 0
    assert [p["prompt"] for p in prompts] == ["<<user>> hi\n<<assistant>> "]
    assert "finish:" in capsys.readouterr().err
