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
from pathlib import Path

from draftwise.benchmark.runner import ConfigResult, RequestResult
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


def run_hf_peers(target: str, draft: str | None, prompts: list[tuple[str, str]], max_tokens: int,
                 progress: bool = True) -> list[ConfigResult]:
    import torch
    from tqdm import tqdm

    tokenizer, model = load_hf(target)
    configs: dict[str, dict] = {"hf plain": {}, "hf prompt lookup": {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}}
    if draft is not None:
        configs["hf assistant"] = {"assistant_model": load_hf(draft)[1]}
    results = []
    for name, extra in configs.items():
        result = ConfigResult(name, reference="hf plain")
        warm = tokenizer(prompts[0][1], return_tensors="pt")
        with torch.inference_mode():
            model.generate(**warm, max_new_tokens=4, do_sample=False, **extra)
        for category, prompt in tqdm(prompts, desc=name, disable=not progress, leave=False):
            inputs = tokenizer(prompt, return_tensors="pt")
            started = time.perf_counter()
            with torch.inference_mode():
                output = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, **extra)
            seconds = time.perf_counter() - started
            new = output[0, inputs["input_ids"].shape[1]:].tolist()
            result.requests.append(RequestResult(category, len(new), seconds, float("nan"), new, 0))
        results.append(result)
    return results
