"""The target's hidden states handed to drafters that read them (EAGLE and Medusa heads draft from
the target's own features): which layers a batch's verification pass captures, and which of the
fed positions each row keeps, so that no extra pass is ever run for them."""

from __future__ import annotations

import torch

from draftwise.engine.sequence import Sequence, rows_by_method
from draftwise.speculative.drafter import Drafter


def reads_hidden(drafters: dict[str, Drafter], seq: Sequence) -> bool:
    return seq.method is not None and bool(getattr(drafters[seq.method].proposer, "hidden_layers", ()))


def hidden_layers(drafters: dict[str, Drafter], batch: list[Sequence]) -> tuple[int, ...]:
    """The target layers whose hidden states the drafters of this batch's rows read (most read none)."""
    layers = {layer for method in rows_by_method(batch)
              for layer in getattr(drafters[method].proposer, "hidden_layers", ())}
    return tuple(sorted(layers))


def kept_positions(cu_num_tokens: list[int], num_pending: list[int], num_accepted: list[int],
                   paths: dict[int, list[int]]) -> list[torch.Tensor]:
    """Per row, the indices into the pass's fed tokens of those that stay committed: what the row
    lacked before its draft, then its kept draft tokens (a chain's first ones, a tree's path)."""
    return [cu_num_tokens[b] + torch.tensor(
        list(range(pending)) + [pending + node for node in (paths[b] if b in paths else range(num_accepted[b]))])
        for b, pending in enumerate(num_pending)]


def hand_hidden(drafters: dict[str, Drafter], batch: list[Sequence], hidden: dict[int, torch.Tensor],
                kept: list[torch.Tensor]) -> None:
    """Give each drafter that reads hidden states its rows' kept states ({layer: per row [n, H]})."""
    for method, rows in rows_by_method(batch).items():
        proposer = drafters[method].proposer
        if getattr(proposer, "hidden_layers", ()):
            proposer.on_hidden([batch[b] for b in rows],
                               {layer: [hidden[layer][kept[b]] for b in rows] for layer in proposer.hidden_layers})
