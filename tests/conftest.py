from pathlib import Path

import pytest

from tests.tiny_models import write_tiny_gguf, write_tiny_model


@pytest.fixture(scope="session", autouse=True)
def profiles_in_tmp(tmp_path_factory):
    """Cost models measured by tests stay out of the user's cache."""
    import os

    from draftwise.speculative.control.profile import PROFILES_ENV

    previous = os.environ.get(PROFILES_ENV)
    os.environ[PROFILES_ENV] = str(tmp_path_factory.mktemp("profiles"))
    yield
    if previous is None:
        os.environ.pop(PROFILES_ENV, None)
    else:
        os.environ[PROFILES_ENV] = previous


@pytest.fixture(scope="session", autouse=True)
def kernel_choices_in_tmp(tmp_path_factory):
    """Kernel choices measured by tests (int8 activations per layer shape) stay out of the user's cache."""
    from draftwise.quant import activation_choice

    path = tmp_path_factory.mktemp("kernel-choices") / "int8-activations.json"
    original = activation_choice.choices_path
    activation_choice.choices_path = lambda: path
    yield
    activation_choice.choices_path = original


@pytest.fixture(scope="session", autouse=True)
def distilled_examples_in_tmp(tmp_path_factory):
    """Answers distilled for heads trained by tests stay out of the user's cache."""
    from draftwise.training import distill

    folder = tmp_path_factory.mktemp("distilled")
    original = distill.distilled_folder
    distill.distilled_folder = lambda: folder
    yield
    distill.distilled_folder = original


@pytest.fixture
def drafting_pays(monkeypatch):
    """Adaptive drafters plan with `tests.drafting.DRAFTING_PAYS` instead of costs measured here."""
    from tests.drafting import DRAFTING_PAYS

    monkeypatch.setattr("draftwise.speculative.drafter.load_or_measure", lambda *args, **kwargs: DRAFTING_PAYS)
    # ... and keep them: costs learned from this machine's steps would replace them while serving
    monkeypatch.setattr("draftwise.speculative.drafter.live_costs", lambda *args, **kwargs: DRAFTING_PAYS)


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen"), "qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_tools(tmp_path_factory) -> Path:
    """A tiny model whose chat template renders tools, with `<tool_call>` tags as special tokens."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny_tools"), "qwen2", seed=0, tools=True)


@pytest.fixture(scope="session")
def random_draft(tmp_path_factory) -> Path:
    """Another random model with the same tokenizer: it agrees with tiny_qwen almost never."""
    return write_tiny_model(tmp_path_factory.mktemp("random_draft"), "qwen2", seed=5, num_layers=1)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=1, tie=True)


@pytest.fixture(scope="session")
def gguf_cache(tmp_path_factory) -> Path:
    """Where conversions of test GGUF files go (not the user's cache)."""
    return tmp_path_factory.mktemp("draftwise-cache")


@pytest.fixture(scope="session")
def tiny_llama_gguf(tiny_llama, tmp_path_factory) -> Path:
    return write_tiny_gguf(tiny_llama, tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def tiny_qwen_gguf(tiny_qwen, tmp_path_factory) -> Path:
    return write_tiny_gguf(tiny_qwen, tmp_path_factory.mktemp("gguf") / "tiny-qwen.gguf")


@pytest.fixture(scope="session")
def tiny_llm(tiny_qwen):
    from draftwise import LLM

    return LLM(str(tiny_qwen), max_model_len=256, max_num_seqs=16, progress=False)
