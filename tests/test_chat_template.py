"""Chat templates: where they come from, and how they fail (ChatTemplateError, never a traceback)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from draftwise.errors import ChatTemplateError, DraftwiseError
from draftwise.tokenizer import Tokenizer


def tokenizer_folder(tmp_path: Path, model: Path, config: dict, template_file: str | None = None) -> Path:
    """A folder with the model's tokenizer.json and the given tokenizer_config.json (and chat_template.jinja)."""
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    shutil.copy(model / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", **config}))
    if template_file is not None:
        (folder / "chat_template.jinja").write_text(template_file)
    return folder


def with_template(tmp_path: Path, model: Path, template: str, **config) -> Tokenizer:
    return Tokenizer(tokenizer_folder(tmp_path, model, {"chat_template": template, **config}))


HI = [{"role": "user", "content": "hi"}]


# --- where the template comes from --------------------------------------------------------------
def test_template_file_wins_over_tokenizer_config(tiny_qwen, tmp_path):
    folder = tokenizer_folder(tmp_path, tiny_qwen, {"chat_template": "from the config"}, template_file="from the file")
    assert Tokenizer(folder).apply_chat_template(HI) == "from the file"


def test_tokenizer_config_list_form_takes_the_default(tiny_qwen, tmp_path):
    templates = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ messages[0].content }}"}]
    assert with_template(tmp_path, tiny_qwen, templates).apply_chat_template(HI) == "hi"


def test_gguf_template_reaches_the_tokenizer(tiny_qwen, tmp_path, monkeypatch):
    from draftwise.loading.resolve import resolve_model
    from tests.tiny_models import write_tiny_gguf

    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    path = write_tiny_gguf(tiny_qwen, tmp_path / "templated.gguf", chat_template="gguf says {{ messages[0].content }}")
    assert Tokenizer(resolve_model(str(path), progress=False)).apply_chat_template(HI) == "gguf says hi"


@pytest.mark.parametrize("config", [{}, {"chat_template": None}, {"chat_template": [{"name": "rag", "template": "x"}]}])
def test_model_without_template_says_so(tiny_qwen, tmp_path, config):
    tokenizer = Tokenizer(tokenizer_folder(tmp_path, tiny_qwen, config))
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        tokenizer.apply_chat_template(HI)


# --- template errors ---------------------------------------------------------------------------
def test_raise_exception_message_surfaces(tiny_qwen, tmp_path):
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('Roles must alternate, system first') }}{% endif %}"
    tokenizer = with_template(tmp_path, tiny_qwen, template)
    with pytest.raises(ChatTemplateError, match="refused the conversation: Roles must alternate, system first") as error:
        tokenizer.apply_chat_template(HI)
    assert isinstance(error.value, ValueError) and isinstance(error.value, DraftwiseError)


def test_syntax_error_names_the_line(tiny_qwen, tmp_path):
    tokenizer = with_template(tmp_path, tiny_qwen, "{% for m in messages %}\n{{ m.content | shout }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match=r"does not parse \(line 2\).*shout"):
        tokenizer.apply_chat_template(HI)


def test_bad_message_shape_is_a_chat_template_error(tiny_qwen, tmp_path):
    template = "{% for m in messages %}\n{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}{% endfor %}"
    tokenizer = with_template(tmp_path, tiny_qwen, template)
    assert tokenizer.apply_chat_template(HI) == "<|im_start|>user\nhi"
    with pytest.raises(ChatTemplateError, match="at line 2: TypeError"):
        tokenizer.apply_chat_template([{"role": "user", "content": None}])
