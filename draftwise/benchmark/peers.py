"""Peers: other engines measured in the same run as draftwise, on the same weights and prompts
(`draftwise bench --peers hf`). A peer that is not run shows in the table as "not run", with why; a
peer's figure is never quoted from elsewhere.

Hugging Face transformers (`hf`): transformers loads a GGUF file by dequantizing it (here to
float32, its only CPU path worth timing), so the peer computes with the same weights draftwise
dequantizes for its fp32 reference; draftwise's default int4 path rounds differently, so a peer's
outputs are compared with the peer's own plain decoding, not with draftwise's. Configs, each greedy
at batch 1 (HF refuses assisted decoding above 1):
  hf plain            `generate()`
  hf assistant        `generate(assistant_model=draft)` (the draft model's GGUF; HF picks k itself)
  hf prompt lookup    `generate(prompt_lookup_num_tokens=10)`
transformers is an optional dependency (the `test` and `bench` extras install it).
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

from draftwise.benchmark.runner import RequestResult
from draftwise.errors import InvalidParameterError

PROMPT_LOOKUP_TOKENS = 10
PEERS = {"hf": "hf (transformers)"}  # --peers name -> its row in a table when not run


def peer_recipes(requested: tuple[str, ...], target: str, draft: str | None,
                 max_tokens: int) -> tuple[list["HFRecipe"], dict[str, str]]:
    """The recipes of the requested peers that can run here, and the absent peers (row -> why)."""
    recipes, absent = [], {}
    for peer, row in PEERS.items():
        why = f"--peers {peer} runs it" if peer not in requested else hf_unavailable(target)
        if why is None:
            recipes.append(HFRecipe(target, draft, max_tokens))
        else:
            absent[row] = why
    return recipes, absent


def hf_unavailable(model: str) -> str | None:
    """Why transformers cannot run on `model` here, or None."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed"
    try:
        gguf_path(model)
    except InvalidParameterError:
        return "it needs a GGUF model"
    return None


def gguf_path(model: str) -> Path:
    """The GGUF file of `model`: a .gguf path, or a known model's file (fetched when draftwise loads it)."""
    from draftwise.loading.registry import KNOWN_MODELS
    from draftwise.loading.resolve import known_model_file

    path = Path(model)
    if path.suffix == ".gguf" and path.is_file():
        return path
    if model in KNOWN_MODELS:
        return known_model_file(model)
    raise InvalidParameterError(f"--peers hf needs a GGUF model (a known name or a .gguf file), got {model!r}")


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

    def run(self, item: tuple[str, str]) -> RequestResult:
        category, prompt = item  # peers run prompts, no probes
        started = time.perf_counter()
        new = self._generate(prompt, self.max_tokens)
        seconds = time.perf_counter() - started  # tokenizing included, as draftwise's seconds include it
        return RequestResult(category, len(new), seconds, float("nan"), new, 0)

    def _generate(self, prompt: str, max_tokens: int) -> list[int]:
        import torch

        ids = peer_prompt_ids(self.tokenizer, prompt)
        inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        with torch.inference_mode():
            output = self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, **self.extra)
        return output[0, len(ids):].tolist()


def peer_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt's ids as draftwise's tokenizer gives them (`Tokenizer.encode`): its text as written
    (a chat template's BOS included), a BOS put first only where the model adds one and the text
    has none (a transformers tokenizer adds it even before the template's own: two)."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    if getattr(tokenizer, "add_bos_token", False) and bos is not None and ids[:1] != [bos]:
        ids = [bos, *ids]
    return ids


@dataclass(frozen=True, slots=True)
class HFRecipe:
    """The hf configs, built together (they share one loaded target, in one worker process)."""
    target: str
    draft: str | None
    max_tokens: int

    def build(self) -> list[HFConfig]:
        return hf_configs(self.target, self.draft, self.max_tokens)


def hf_configs(target: str, draft: str | None, max_tokens: int) -> list[HFConfig]:
    """hf plain, hf prompt lookup and (with a draft model) hf assistant, sharing one loaded target."""
    tokenizer, model = load_hf(target)
    configs = [HFConfig("hf plain", tokenizer, model, {}, max_tokens),
               HFConfig("hf prompt lookup", tokenizer, model, {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS},
                        max_tokens)]
    if draft is not None:
        configs.append(HFConfig("hf assistant", tokenizer, model, {"assistant_model": load_hf(draft)[1]}, max_tokens))
    return configs
