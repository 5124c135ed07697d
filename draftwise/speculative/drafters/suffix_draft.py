"""Suffix decoding with a draft model behind it: free drafts where the text was seen, a model where not.

Suffix decoding drafts long, right runs where the text repeats (a code edit copying its prompt, a
request seen before) and nothing where it is new (a comment written into a copied function, a
summary's own sentences). A draft model drafts new text, at a price. This drafter asks the suffix
tree first, per row and step: when its continuation of the context is expected to have
`suffix_min_expected` tokens accepted (the sum of its path probabilities), that continuation is the
draft; otherwise the draft model drafts (the hybrid of Arctic Inference, there with an MLP speculator).

The draft model's cache simply falls behind while the suffix tree drafts: its next draft absorbs the
committed tokens it missed (at most its context window). `lag` reports that backlog only for a row
the draft model will serve, so the controller charges a catch-up where one happens. The cost model is
the draft model's (a suffix draft costs ~0.1 ms: the profile would otherwise time the suffix tree on
its repeated sample text).
"""

from __future__ import annotations

import dataclasses

from draftwise.errors import InvalidParameterError
from draftwise.speculative.control.profile import measure
from draftwise.speculative.drafters.draft_model import DraftModelOptions, build_draft_model, check_draft_model
from draftwise.speculative.drafters.suffix import SuffixOptions, SuffixProposer, as_draft, expected_accepted
from draftwise.speculative.proposer import Draft, Footprint, Proposer
from draftwise.speculative.registry import DrafterSpec, Target, option, register
from draftwise.speculative.sequence import SequenceState
from draftwise.text.tokenizer import Tokenizer


class SuffixThenModelProposer:
    def __init__(self, suffix: SuffixProposer, model: Proposer, min_expected: float) -> None:
        self.suffix = suffix
        self.model = model
        self.min_expected = min_expected
        self.catch_up_window = model.catch_up_window

    def _suffix_drafts(self, seq: SequenceState) -> bool:
        """The suffix tree's longest continuation here is expected to have enough tokens accepted."""
        found = self.suffix.continuation(seq, self.suffix.options.suffix_max_depth)
        return expected_accepted(found) >= self.min_expected

    def tree_nodes(self, k: int) -> int:
        """Its suffix trees hold at most k nodes; the draft model's drafts what that model's hold."""
        model_nodes = getattr(self.model, "tree_nodes", None)
        return max(k, model_nodes(k) if model_nodes else k)

    def propose(self, seqs: list[SequenceState], num_tokens: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        by_model = []  # rows the draft model serves
        for b, (seq, k) in enumerate(zip(seqs, num_tokens)):
            if k > 0 and self._suffix_drafts(seq):
                drafts[b] = as_draft(self.suffix.continuation(seq, k))
            elif k > 0:
                by_model.append(b)
        if by_model:
            for b, draft in zip(by_model, self.model.propose([seqs[b] for b in by_model],
                                                             [num_tokens[b] for b in by_model])):
                drafts[b] = draft
        return drafts

    def on_verified(self, seqs: list[SequenceState], num_accepted: list[int]) -> None:
        self.suffix.on_verified(seqs, num_accepted)
        self.model.on_verified(seqs, num_accepted)  # (a row it did not draft for keeps its cache as it was)

    def release(self, seq: SequenceState) -> None:
        self.suffix.release(seq)
        self.model.release(seq)

    def forget_history(self) -> None:
        self.suffix.forget_history()

    def reset_prefix_cache(self) -> None:
        reset = getattr(self.model, "reset_prefix_cache", None)
        if reset is not None:
            reset()

    def lag(self, seq: SequenceState) -> int:
        return 0 if self._suffix_drafts(seq) else self.model.lag(seq)

    def footprint(self) -> Footprint:
        suffix, model = self.suffix.footprint(), self.model.footprint()
        return Footprint(suffix.weights_bytes + model.weights_bytes, model.kv_bytes_per_token)


def _option_fields(options: type) -> list[tuple]:
    return [(f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata))
            for f in dataclasses.fields(options)]


def _parts(options) -> tuple[DraftModelOptions, SuffixOptions]:
    """The draft model's and the suffix tree's options (each validated by its own dataclass)."""
    def part(kind: type):
        return kind(**{f.name: getattr(options, f.name) for f in dataclasses.fields(kind)})
    return part(DraftModelOptions), part(SuffixOptions)


def _check_options(options) -> None:
    _parts(options)
    value = options.suffix_min_expected
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidParameterError(f"suffix_min_expected must be a number > 0, got {value!r}")


# The draft model's options, the suffix tree's, and the rule that picks between them.
SuffixDraftOptions = dataclasses.make_dataclass(
    "SuffixDraftOptions",
    _option_fields(DraftModelOptions) + _option_fields(SuffixOptions) + [
        ("suffix_min_expected", float, option(2.0, "the suffix tree drafts where its continuation is expected to "
                                                   "have this many tokens accepted; elsewhere the draft model"))],
    namespace={"__post_init__": _check_options}, slots=True)
SuffixDraftOptions.__module__ = __name__


def check_suffix_draft(options, target_tokenizer: Tokenizer, target_name: str, progress: bool) -> None:
    check_draft_model(_parts(options)[0], target_tokenizer, target_name, progress)


def build_suffix_draft(target: Target, options) -> SuffixThenModelProposer:
    model_options, suffix_options = _parts(options)
    return SuffixThenModelProposer(SuffixProposer(suffix_options), build_draft_model(target, model_options),
                                   options.suffix_min_expected)


def profile_draft_model(runner, proposer: SuffixThenModelProposer, tokenizer: Tokenizer, max_draft_tokens: int):
    """The draft model's costs: what a step costs when this drafter spends anything."""
    return measure(runner, proposer.model, tokenizer, max_draft_tokens)


register(DrafterSpec("suffix_draft", "suffix decoding where the text was seen before, the draft model where it "
                                     "was not", SuffixDraftOptions, build_suffix_draft, check=check_suffix_draft,
                     per_request=False, benchmark_by_default=False,
                     profile=profile_draft_model))
