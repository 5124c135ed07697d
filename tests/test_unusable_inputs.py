"""Files and folders the process may not read or write, and a dtype it cannot hold weights in: one
clear error naming the problem, never a traceback (the tests run as root, where file modes do not
apply, so the refusals are injected)."""

from __future__ import annotations

import shutil

import pytest
from safetensors import SafetensorError

from draftwise import LLM
from draftwise.errors import CacheNotWritableError, ModelFormatError
from draftwise.loading import gguf_file, hf_folder
from draftwise.loading.resolve import resolve_model
from draftwise.quant import packed_cache


def test_an_unreadable_gguf_is_named(tiny_qwen_gguf, monkeypatch):
    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(gguf_file, "open", refused, raising=False)
    with pytest.raises(ModelFormatError, match="tiny-qwen.gguf: cannot be read \\(Permission denied\\)"):
        gguf_file.GGUFFile(tiny_qwen_gguf)


def test_unreadable_weights_are_named_as_unreadable_not_corrupt(tiny_qwen, monkeypatch):
    monkeypatch.setattr(hf_folder, "_readable", lambda path: False)
    with pytest.raises(ModelFormatError, match="model.safetensors: cannot be read"):
        LLM(str(tiny_qwen), progress=False, max_model_len=64)


def test_a_cache_that_cannot_be_written_is_named_with_the_way_out(tiny_qwen_gguf, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("DRAFTWISE_CACHE", str(blocker / "cache"))  # (mkdir under a file fails, as root too)
    with pytest.raises(CacheNotWritableError, match="cannot be written.*set DRAFTWISE_CACHE"):
        resolve_model(str(tiny_qwen_gguf), progress=False)


def test_a_model_folder_the_packed_cache_cannot_be_written_in_still_loads(tiny_qwen, tmp_path, monkeypatch):
    folder = tmp_path / "read-only-model"
    shutil.copytree(tiny_qwen, folder, ignore=shutil.ignore_patterns("packed-*"))  # (other tests write some)

    def refused(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: Permission denied (os error 13)")

    monkeypatch.setattr(packed_cache, "save_file", refused)
    llm = LLM(str(folder), progress=False, max_model_len=64, quantization="int8")
    assert llm.generate("hi")[0].finish_reason in ("stop", "length")
    assert not list(folder.glob("packed-*"))


@pytest.mark.parametrize("dtype", ["int8", "float64", 16])
def test_a_dtype_that_is_no_float_format_is_refused_by_name(tiny_qwen, dtype):
    import torch

    from draftwise.errors import InvalidParameterError

    value = getattr(torch, dtype) if dtype in ("int8", "float64") else dtype
    with pytest.raises(InvalidParameterError, match="dtype must be one of"):
        LLM(str(tiny_qwen), progress=False, max_model_len=64, dtype=value)
