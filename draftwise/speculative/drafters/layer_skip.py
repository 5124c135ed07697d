"""Self-speculation: the target's first L layers, final norm and LM head draft for the full model.

The draft pass writes keys/values of layers < L into the target's own cache at the positions the
verification pass then overwrites with all layers, so drafting needs no cache of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftwise.errors import InvalidParameterError
from draftwise.runner.model_runner import ModelRunner
from draftwise.speculative.autoregressive import check_confidence, draft_autoregressively
from draftwise.speculative.proposer import CachelessProposer, Draft
from draftwise.speculative.registry import DrafterSpec, Target, option, register
from draftwise.speculative.sequence import SequenceState


class LayerSkipProposer(CachelessProposer):
    """(It shares the target's cache: nothing of its own to roll back or catch up on.)"""

    def __init__(self, target_runner: ModelRunner, num_layers: int, confidence_threshold: float = 0.0) -> None:
        self.runner = target_runner
        self.num_layers = num_layers
        self.confidence_threshold = confidence_threshold

    def propose(self, seqs: list[SequenceState], num_tokens: list[int]) -> list[Draft]:
        rows = [seq.row for seq in seqs]
        lengths = [self.runner.length(row) for row in rows]
        try:
            return draft_autoregressively(self.runner, rows, seqs, num_tokens, num_layers=self.num_layers,
                                          confidence_threshold=self.confidence_threshold)
        finally:
            for row, length in zip(rows, lengths):
                self.runner.truncate(row, length)  # the target's verification pass starts from here



@dataclass(slots=True)
class LayerSkipOptions:
    num_layers: int | None = option(None, "target layers that draft (default: half)", flag="--layers", cost=True)
    draft_confidence_threshold: float = option(0.0, "stop drafting after a token drafted with less probability "
                                               "(0: never)", flag="--confidence")

    def __post_init__(self) -> None:
        if self.num_layers is not None and (not isinstance(self.num_layers, int) or isinstance(self.num_layers, bool)
                                            or self.num_layers < 1):
            raise InvalidParameterError(f"num_layers must be a positive integer, got {self.num_layers!r}")
        check_confidence(self.draft_confidence_threshold)


def build_layer_skip(target: Target, options: LayerSkipOptions) -> LayerSkipProposer:
    total = target.runner.model.config.num_hidden_layers
    num_layers = options.num_layers or max(1, total // 2)
    if num_layers >= total:
        raise InvalidParameterError(f"layer_skip num_layers must be below the target's {total} layers")
    return LayerSkipProposer(target.runner, num_layers, options.draft_confidence_threshold)


register(DrafterSpec("layer_skip", "the target's own first L layers + final norm + LM head, sharing its KV cache",
                     LayerSkipOptions, build_layer_skip, benchmark_by_default=False))
