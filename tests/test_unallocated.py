"""Loading and serving on the CPU without torch's compiler: a model's shell is built with its random
initialization skipped (`model/unallocated.py`), grammar masks come through llguidance's numpy API,
and Triton is imported only for CUDA tensors. Each import of the compiler cost ~190 MB resident."""

import json
import subprocess
import sys
import textwrap

import torch
from torch.nn import init

from draftwise.model.config import ModelConfig
from draftwise.model.unallocated import unallocated_transformer
from tests.cache_env import own_cache_env

CHECK = textwrap.dedent("""
    import sys
    from draftwise import LLM, SamplingParams
    for quantization in ("none", "int4"):
        llm = LLM({folder!r}, quantization=quantization, max_model_len=128, progress=False)
        llm.generate(["a b"], SamplingParams(max_tokens=4, temperature=0))
        llm.generate(["a b"], SamplingParams(max_tokens=4, temperature=0,
                                             structured_outputs={{"choice": ["yes", "no"]}}))
    heavy = sorted(name for name in ("torch._dynamo", "torch._inductor", "triton") if name in sys.modules)
    assert not heavy, f"imported on the CPU path: {{heavy}}"
""")


def test_a_model_loads_and_serves_on_the_cpu_without_the_compiler(tiny_qwen, tmp_path):
    done = subprocess.run([sys.executable, "-c", CHECK.format(folder=str(tiny_qwen))], capture_output=True,
                          text=True, timeout=600, env=own_cache_env(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_shell_has_no_storage_and_torch_init_is_restored(tiny_qwen):
    fills = {name: getattr(init, name) for name in ("normal_", "uniform_", "kaiming_uniform_")}
    model = unallocated_transformer(ModelConfig.from_hf_dict(json.loads((tiny_qwen / "config.json").read_text())))
    assert all(tensor.is_meta for tensor in model.state_dict().values())
    assert {name: getattr(init, name) for name in fills} == fills
    weight = torch.zeros(3)
    init.normal_(weight)  # the real one again
    assert weight.abs().sum() > 0


def test_another_thread_initializes_its_modules_while_a_shell_is_built(tiny_qwen, monkeypatch):
    """The fills are patched for the whole process while a shell is built, but skipped only in the
    building thread: a module made meanwhile in another thread gets its random weights."""
    import threading

    from draftwise.model import unallocated

    built, made = threading.Event(), {}
    config = ModelConfig.from_hf_dict(json.loads((tiny_qwen / "config.json").read_text()))
    real_transformer = unallocated.Transformer

    def slow_shell(config):  # (the shell is being built while the other thread makes its layer)
        thread = threading.Thread(target=lambda: made.setdefault("layer", _seeded_layer()))
        thread.start()
        thread.join()
        built.set()
        return real_transformer(config)

    monkeypatch.setattr(unallocated, "Transformer", slow_shell)
    unallocated.unallocated_transformer(config)
    assert built.is_set() and not made["layer"].weight.is_meta
    assert torch.equal(made["layer"].weight, _seeded_layer().weight)  # initialized, not left as allocated


def _seeded_layer() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4)
