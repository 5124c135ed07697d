"""How much memory a model's tensors take (the planner's memory report, a draft model's footprint)."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def module_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor a model holds, once each: parameters, buffers and packed weights kept as
    attributes (not those on the meta device)."""
    seen: set[int] = set()
    for module in model.modules():
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for tensor in tensors:
            if id(tensor) not in seen and tensor.device.type != "meta":
                seen.add(id(tensor))
                yield tensor


def module_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor a model holds (`module_tensors`)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in module_tensors(model))


def bytes_read_per_step(model: torch.nn.Module) -> int:
    """Bytes a decoding step reads: every tensor but the embedding table, of which it reads one row
    per token (unless the LM head is that same table, as in tied models computed in full precision)."""
    embedding = getattr(model.embed_tokens, "weight", None)
    if embedding is not None and getattr(model.lm_head, "weight", None) is embedding:
        return module_bytes(model)
    return module_bytes(model) - module_bytes(model.embed_tokens)
