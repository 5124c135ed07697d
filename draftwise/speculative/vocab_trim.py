"""A draft model whose LM head scores only the N most frequent tokens.

The 0.5B Qwen's head is 151,936 x 896, about a quarter of its weights, so every draft step reads
it in full although almost every drafted token comes from a few ten thousand of them. The trimmed
head keeps the rows of the N most frequent tokens (plus every special token), and its logits are
scattered back to full vocabulary ids with -inf elsewhere. Speculation stays lossless: a token
the draft cannot propose is one the target produces itself at its verification step (for sampled
requests the draft distribution is simply zero there, which rejection sampling allows).

Frequencies come from a corpus every installation ships: the Python standard library's own
source files (code, comments and docstrings; the first `CORPUS_CHARS` characters in a fixed
order). The ranking is computed once per tokenizer and cached.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch import nn

from draftwise.paths import cache_root
from draftwise.quant.apply import quantized_layer
from draftwise.text.tokenizer import Tokenizer

CORPUS_CHARS = 6_000_000


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py"))


def token_counts(tokenizer: Tokenizer) -> np.ndarray:
    """How often each token id occurs in the corpus ([V] int64), cached per tokenizer."""
    digest = hashlib.sha256(tokenizer.path.read_bytes()).hexdigest()[:16]
    cache = cache_root() / "vocab" / f"stdlib-counts-{digest}-{CORPUS_CHARS}.npy"
    if cache.is_file():
        try:
            return np.load(cache)
        except (OSError, ValueError):
            pass
    texts, total = [], 0
    for file in corpus_files():
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text[:CORPUS_CHARS - total])
        total += len(texts[-1])
        if total >= CORPUS_CHARS:
            break
    counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for ids in tokenizer.encode_batch(texts):
        np.add.at(counts, np.asarray(ids, dtype=np.int64), 1)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        np.save(cache, counts)
    except OSError:
        pass
    return counts


def kept_token_ids(tokenizer: Tokenizer, size: int) -> torch.Tensor:
    """[N] sorted ids: every special token, then the most frequent others (ties: smaller id)."""
    counts = token_counts(tokenizer)
    special = sorted(tokenizer.special_token_ids)
    special_set = set(special)
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count descending, then id
    others = [int(i) for i in order if int(i) not in special_set][:max(0, size - len(special))]
    return torch.tensor(sorted(special + others), dtype=torch.long)


class TrimmedLMHead(nn.Module):
    """LM head over `kept_ids` only; forward returns full-vocabulary logits (-inf off the list)."""

    def __init__(self, head: nn.Module, kept_ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.head = head  # [N, H] rows of the original head, in the model's weight format
        self.kept_ids = kept_ids
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kept = self.head(hidden)[..., :len(self.kept_ids)]  # [..., N] (the head may carry padding rows)
        logits = kept.new_full((*kept.shape[:-1], self.vocab_size), float("-inf"))  # [..., V]
        return logits.index_copy_(-1, self.kept_ids.to(kept.device), kept)


def trim_lm_head(model: nn.Module, kept_ids: torch.Tensor, vocab_size: int | None = None) -> None:
    """Replace `model.lm_head` by a `TrimmedLMHead` in the same weight format as the rest, whose
    logits span `vocab_size` ids (default: the model's vocabulary)."""
    model.lm_head = TrimmedLMHead(lm_rows_layer(model, kept_ids), kept_ids.to(model.norm.weight.device),
                                  vocab_size or model.config.vocab_size)


def lm_rows_layer(model: nn.Module, kept_ids: torch.Tensor) -> nn.Module:
    """A layer computing x @ W[kept_ids].T with the model's LM head rows W, in the model's weight
    format ([..., H] -> [..., N'], N' >= N: int4 pads to a multiple of 16 rows)."""
    weight = head_rows(model, kept_ids).float().contiguous()  # [N, H]
    mode = model.quantization.mode
    if mode.startswith("int4") and len(kept_ids) % 16:  # the packed int4 kernel wants N % 16 == 0
        weight = torch.cat([weight, weight.new_zeros(16 - len(kept_ids) % 16, weight.shape[1])])
    if mode != "none":
        head = quantized_layer(mode, weight)
    else:
        weight = weight.to(model.norm.weight.dtype)
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        head.weight = nn.Parameter(weight, requires_grad=False)
    return head


def rows_dtype(layer: nn.Module) -> torch.dtype:
    """The float type a rows layer takes: its weight's (a float16/bfloat16 model's), else float32
    (quantized rows cast their input themselves)."""
    weight = getattr(layer, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) and weight.is_floating_point() else torch.float32


def head_rows(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [N] of the model's LM head weight (its embedding table when tied) as float values
    [N, H], made from those rows alone: dequantizing all of the 0.5B's 151,936 int4 rows first (in
    double precision) took ~3 GB for a moment to keep 32,768 of them."""
    if model.config.tie_word_embeddings:
        table = model.embed_tokens
        return table.weight[ids] if isinstance(table, nn.Embedding) else table.rows(ids)
    head = model.lm_head
    return head.weight[ids] if isinstance(head, nn.Linear) else head.dequantized(ids)
