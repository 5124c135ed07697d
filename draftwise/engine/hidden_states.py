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


class HiddenRecorder:
    """Keeps, for every request, the target's hidden states at each committed position, read from the
    passes decoding runs anyway (self-distillation trains heads on them: no second pass over the text).

    A request's position p holds the state computed when token p was fed, so the newest token, never
    fed, has none: a text of S tokens has states at positions 0..S-2. A request recomputed after being
    preempted overwrites the positions it feeds again; one already running when the recorder came
    (its first recorded pass does not start at position 0) is not recorded."""

    def __init__(self, layers: tuple[int, ...]) -> None:
        self.layers = tuple(sorted(set(layers)))
        self._states: dict[str, dict[int, list[torch.Tensor]]] = {}  # request -> layer -> pieces [n, H]

    def record(self, batch: list[Sequence], starts: list[int], hidden: dict[int, torch.Tensor],
               kept: list[torch.Tensor]) -> None:
        """starts: each row's first fed position; hidden: layer -> [T, H] over the pass's fed tokens;
        kept: per row, the indices into them of the tokens that stay committed (in position order)."""
        for b, seq in enumerate(batch):
            if seq.request_id not in self._states:
                if starts[b] > 0:
                    continue  # (admitted before the recorder: its earlier positions are gone)
                self._states[seq.request_id] = {layer: [] for layer in self.layers}
            pieces = self._states[seq.request_id]
            held = sum(len(piece) for piece in pieces[self.layers[0]])  # positions held
            if starts[b] < held:  # fed again (a recomputed request): keep what comes before
                for layer in self.layers:
                    pieces[layer] = [torch.cat(pieces[layer])[:starts[b]]]
            elif starts[b] > held:
                raise RuntimeError(f"request {seq.request_id}: positions {held}..{starts[b] - 1} were never fed "
                                   "to a recorded pass")
            for layer in self.layers:
                pieces[layer].append(hidden[layer][kept[b]].detach())  # [n, H] (indexing copies)

    def take(self, request_id: str) -> dict[int, torch.Tensor]:
        """layer -> [positions, H] the request's states (forgotten here)."""
        pieces = self._states.pop(request_id, {})
        return {layer: torch.cat(chunks) for layer, chunks in pieces.items() if chunks}
