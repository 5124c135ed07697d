"""One request's place in its grammar, kept equal to the tokens it has committed.

The matcher only ever moves forward over committed tokens (`sync`); what a step drafts is checked
without moving it (`valid_prefix`), and the masks of a draft's positions are computed by advancing
through the draft and rolling back (`masks.fill_masks`). So a rejected draft needs no undo."""

from __future__ import annotations

import llguidance

from draftwise.errors import DraftwiseError


class GrammarViolation(DraftwiseError):
    """A committed token the grammar does not allow: a fault of the engine, never of the request."""


class RequestGrammar:
    def __init__(self, matcher: llguidance.LLMatcher, kind: str, eos_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.kind = kind  # json, regex, choice, grammar or json_object (for messages)
        self.eos_token_ids = eos_token_ids  # what ends the grammar's sentence
        self.num_consumed = 0  # committed output tokens the matcher has advanced over
        self._last: int | None = None  # the last of them

    def sync(self, output_ids: list[int]) -> None:
        """Advance over the output tokens committed since the last call. (Token by token:
        llguidance's consume_tokens refuses a lone end token once the grammar is complete.)"""
        for token in output_ids[self.num_consumed:]:
            if not self.matcher.consume_token(token):
                raise GrammarViolation(f"committed token {token} left the {self.kind} grammar: "
                                       + (self.matcher.get_error().strip() or "refused").splitlines()[0])
            self.num_consumed += 1
            self._last = token

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of these tokens, in order, the grammar allows from here (the matcher stays)."""
        return self.matcher.validate_tokens(token_ids) if token_ids else 0

    def accepted_prefix(self, token_ids: list[int]) -> int:
        """How many of these tokens, in order, committing would take from here: consumed one by one on
        a copy of the matcher, as `sync` consumes them (`valid_prefix`'s check refuses a lone end token
        where the grammar is complete)."""
        trial = self.matcher.deep_copy()
        for i, token in enumerate(token_ids):
            # (a matcher whose mask found a dead end is stopped in error, and then takes an end token)
            if not trial.consume_token(token) or trial.is_error():
                return i
        return len(token_ids)

    def up_to_end(self, token_ids: list[int]) -> list[int]:
        """These tokens up to and including the first end token: the grammar's sentence ends there, so
        nothing after it belongs to the answer (a request under ignore_eos would go on)."""
        end = next((i + 1 for i, token in enumerate(token_ids) if token in self.eos_token_ids), len(token_ids))
        return token_ids[:end]

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces from here (a key, punctuation, the rest of an enum value), as
        the tokenizer would write that text: any other continuation is outside the grammar."""
        return self.matcher.compute_ff_tokens()

    @property
    def finished(self) -> bool:
        """The grammar is complete and its end-of-sequence token consumed (a request that ignores
        EOS goes on after it): nothing more may follow. (A grammar that only allows EOS next is not
        finished: the target still chooses which end token.)"""
        return self._last in self.eos_token_ids and self.matcher.is_stopped()
