"""Hugging Face transformers as a peer, on the same GGUF weights and prompts (`draftwise bench --peers hf`).

transformers loads a GGUF file by dequantizing it (here to float32, its only CPU path worth timing),
so the peer computes with the same weights draftwise dequantizes for its fp32 reference; draftwise's
default int4 path rounds differently, so a peer's outputs are compared with the peer's own plain
decoding, not with draftwise's. Configs, each greedy at batch 1 (HF refuses assisted decoding above 1):
  hf plain            `generate()`
  hf assistant        `generate(assistant_model=draft)` (the draft model's GGUF; HF picks k itself)
  hf prompt lookup    `generate(prompt_lookup_num_tokens=10)`
transformers is an optional dependency (the `test` extra installs it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from draftwise.benchmark.runner import RequestResult
from draftwise.errors import InvalidParameterError

PROMPT_LOOKUP_TOKENS = 10


def gguf_path(model: str) -> Path:
    from draftwise.loading.resolve import known_model_file

    path = Path(model)
    if path.suffix == ".gguf" and path.is_file():
        return path
    try:
        return known_model_file(model)
    except Exception:
        raise InvalidParameterError(f"--peers hf needs a GGUF model (a known name or a .gguf file), got {model!r}") from None


def load_hf(model: str):
    try:
        import transformers
    except ImportError:
        raise InvalidParameterError("--peers hf needs transformers (pip install transformers)") from None
    import torch

    path = gguf_path(model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    network = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                torch_dtype=torch.float32)
    return tokenizer, network.eval()


@dataclass(slots=True)
class HFConfig:
    """One transformers config: `generate()` with `extra` arguments, greedy, batch 1."""
    name: str
    tokenizer: object
    model: object
    extra: dict
    max_tokens: int
    reference: str = "hf plain"

    def warm_up(self, prompt: str) -> None:
        self._generate(prompt, 4)

    def run(self, category: str, prompt: str) -> RequestResult:
        started = time.perf_counter()
        new = self._generate(prompt, self.max_tokens)
        seconds = time.perf_counter() - started  # tokenizing included, as draftwise's seconds include it
        return RequestResult(category, len(new), seconds, float("nan"), new, 0)

    def _generate(self, prompt: str, max_tokens: int) -> list[int]:
        import torch

        inputs = self.tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            output = self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, **self.extra)
        return output[0, inputs["input_ids"].shape[1]:].tolist()


def hf_configs(target: str, draft: str | None, max_tokens: int) -> list[HFConfig]:
    """hf plain, hf prompt lookup and (with a draft model) hf assistant, sharing one loaded target."""
    tokenizer, model = load_hf(target)
    configs = [HFConfig("hf plain", tokenizer, model, {}, max_tokens),
               HFConfig("hf prompt lookup", tokenizer, model, {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS},
                        max_tokens)]
    if draft is not None:
        configs.append(HFConfig("hf assistant", tokenizer, model, {"assistant_model": load_hf(draft)[1]}, max_tokens))
    return configs
