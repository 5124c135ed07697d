"""Grammars compiled against one model's vocabulary, cached, and a fresh matcher per request."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict

import llguidance
import numpy as np
import torch

from draftwise.errors import InvalidParameterError
from draftwise.sampling.structured_params import StructuredOutputsParams
from draftwise.structured.grammars import grammar_definition
from draftwise.structured.masks import allowed_tokens
from draftwise.structured.matcher import RequestGrammar
from draftwise.text.tokenizer import Tokenizer

CACHED_GRAMMARS = 128  # compiled grammars kept (least recently used dropped first)


class GrammarCompiler:
    """One per model: llguidance's view of the tokenizer (built on first use, about a second) and
    the compiled grammars, keyed by their definition. Thread-safe: the server compiles on its
    tokenizing threads so that the engine thread finds a request's grammar compiled."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width (the tokenizer may have fewer tokens)
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = llguidance.LLTokenizer(self.tokenizer.path.read_text(encoding="utf-8"),
                                                           n_vocab=self.vocab_size,
                                                           eos_token=sorted(self.tokenizer.eos_token_ids))
            return self._lltokenizer

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The compiled grammar (a matcher at its start, never advanced); InvalidParameterError
        naming the problem where it does not compile (a bad schema, regex or grammar, or a JSON
        Schema keyword llguidance does not implement: refused, never loosened)."""
        definition = grammar_definition(params)
        with self._lock:
            if definition in self._compiled:
                self._compiled.move_to_end(definition)
                return self._compiled[definition]
        tokenizer = self.lltokenizer
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(definition, tokenizer)
        if is_error or messages:  # (a warning would mean something is not enforced as written)
            raise InvalidParameterError(f"structured_outputs.{params.kind}: {_first_line(messages)}")
        matcher = llguidance.LLMatcher(tokenizer, definition, log_level=0)
        if matcher.is_error():
            raise InvalidParameterError(f"structured_outputs.{params.kind}: {_first_line([matcher.get_error()])}")
        if not matcher.is_accepting() and not self._allows_more_than_ending(matcher):
            raise InvalidParameterError(f"structured_outputs.{params.kind}: matches no text at all (nothing can "
                                        "begin it, and the empty answer is not in it)")
        with self._lock:
            self._compiled[definition] = matcher
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher

    def _allows_more_than_ending(self, matcher: llguidance.LLMatcher) -> bool:
        """Whether the matcher, where it stands, allows some token besides the end tokens (llguidance
        leaves the end tokens allowed where its grammar matches nothing)."""
        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32).copy()  # [W]
        allowed = allowed_tokens(torch.from_numpy(words)[None], self.vocab_size)[0]  # [V]
        allowed[sorted(self.tokenizer.eos_token_ids)] = False
        return bool(allowed.any())

    def request_grammar(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A matcher of its own for one request, at the grammar's start."""
        return RequestGrammar(self.compile(params).deep_copy(), params.kind, self.tokenizer.eos_token_ids)


def _first_line(messages: list[str]) -> str:
    """llguidance's first message on one line, without its caret lines and source echoes."""
    text = (messages[0] if messages else "the grammar does not compile").strip()
    lines = [line.strip() for line in text.splitlines()]
    return " ".join(line for line in lines if line.strip("^ ") and not re.match(r"^\d+ \|", line))
