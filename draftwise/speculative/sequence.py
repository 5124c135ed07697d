"""What speculation needs to know of a request. The engine's `Sequence` provides it; this package
never imports the engine, so drafters, verification and the controller see only these fields."""

from __future__ import annotations

from typing import Protocol

from draftwise.sampling.params import SamplingParams
from draftwise.structured.matcher import RequestGrammar


class SequenceState(Protocol):
    request_id: str
    row: int | None  # the request's row in the target's KV cache while it runs
    params: SamplingParams
    segment: str | None  # a traffic label: the controller keeps statistics per segment
    tenant: str | None  # whose request (the server's API key): text drafted from others' requests stays within it
    prefix_salt: bytes  # the root of its prefix-cache hashes: only sequences with the same salt share blocks
    output_ids: list[int]  # tokens generated so far
    finish_reason: str | None  # why it ended ("stop", "length", "abort", "error"); None while it runs
    grammar: RequestGrammar | None  # structured outputs: the output's place in its grammar (None: free)
    bad_words_ids: list[list[int]]  # params.bad_words as token ids (the logits processors read them)

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output: every committed token."""

    @property
    def end_token_ids(self) -> frozenset[int]:
        """EOS (unless ignored) and stop_token_ids: what min_tokens holds back."""

    @property
    def num_tokens_left(self) -> int:
        """Tokens the request may still emit (max_tokens and the context both count)."""
