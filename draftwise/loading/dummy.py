"""Random weights of a model's real shape (vLLM's `load_format="dummy"`): from config.json alone, so
the engine can be profiled and benchmarked where the weights are not (a GPU machine that can fetch
nothing). Seeded, so two dummy loads of one config are the same model."""

from __future__ import annotations

import torch

from draftwise.model.config import ModelConfig
from draftwise.model.transformer import Transformer
from draftwise.model.unallocated import unallocated_transformer

INIT_STD = 0.02  # the usual initializer range of Llama-family configs
SEED = 0


@torch.no_grad()
def dummy_model(config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> Transformer:
    """A `Transformer` on `device` in `dtype`: matrices ~ N(0, INIT_STD^2), norms 1, biases 0."""
    model = unallocated_transformer(config)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(SEED)
    for name, parameter in model.named_parameters():
        if name.endswith("norm.weight"):
            parameter.fill_(1.0)
        elif name.endswith("bias"):
            parameter.zero_()
        else:
            parameter.normal_(0.0, INIT_STD, generator=generator)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(dtype=dtype)
