"""One request's state while it runs, and the rules that end it."""

from __future__ import annotations

import time

from draftwise.engine.outputs import RequestMetrics, RequestOutput, SampleLogprobs
from draftwise.sampling.params import SamplingParams
from draftwise.speculative.metrics import SpecMetrics
from draftwise.structured.matcher import RequestGrammar
from draftwise.text.tokenizer import IncrementalDetokenizer, Tokenizer


class Sequence:
    def __init__(self, request_id: str, prompt: str, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer, eos_token_ids: frozenset[int], max_len: int) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None
        self.row: int | None = None  # cache row while running
        self.method: str | None = None  # the drafter speculating for it (None: plain decoding)
        self.max_draft_tokens: int | None = None  # a per-request cap on k (None: the drafter's own)
        self.segment: str | None = None  # a traffic label: the controller keeps per-segment statistics
        self.tenant: str | None = None  # whose request: drafts from earlier requests' text stay within a tenant
        self.prefix_salt = b""  # the root of its prefix-cache hashes (`block_manager.prefix_salt`): tenant, cache_salt
        self.error: str | None = None  # why the request failed (finish_reason "error")
        self.error_reason: str | None = None  # a short label of the failure for metrics ("engine_error", ...)
        self.grammar: RequestGrammar | None = None  # structured outputs: where the output is in its grammar
        self.bad_words_ids: list[list[int]] = []  # params.bad_words as token ids (`processors.bad_word_ids`)
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list | None = None  # with params.prompt_logprobs: one entry per prompt token
        self._eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self._stop_token_ids = frozenset(params.stop_token_ids)
        self._max_new = min(params.max_tokens or max_len, max_len - len(prompt_token_ids))
        self._detokenizer = (IncrementalDetokenizer.after(tokenizer, prompt_token_ids, params.skip_special_tokens)
                             if params.detokenize else NoText(tokenizer))
        self._text_end: int | None = None  # where a stop string cut the text
        self.stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
        self.num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache when it first ran
        self._streamed = 0  # characters of text already handed out as deltas
        self.metrics = RequestMetrics(len(prompt_token_ids), 0, time.perf_counter(), None, None, SpecMetrics())

    # --- tokens -----------------------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def decode_token(self, token: int) -> str | None:
        """A token's text alone, special tokens as written (a logprob's `decoded_token`; None under
        detokenize=False, as vLLM leaves it)."""
        if not self.params.detokenize:
            return None
        return self._detokenizer.tokenizer.token_text(token)

    @property
    def end_token_ids(self) -> frozenset[int]:
        """The tokens that end this request: EOS (unless ignored) and stop_token_ids."""
        return self._eos_token_ids | self._stop_token_ids

    @property
    def num_tokens_left(self) -> int:
        """Tokens this request may still emit (max_tokens and the context both count)."""
        return self._max_new - len(self.output_ids)

    def append(self, token_ids: list[int]) -> int:
        """Commit tokens in order until one ends the request; return how many were committed.

        Checking token by token makes a run of several accepted tokens stop exactly where
        one-token-at-a-time decoding would: nothing after EOS, a stop string or the limit is kept.
        """
        committed = 0
        now = time.perf_counter()
        if self.metrics.first_token_time is None and token_ids:
            self.metrics.first_token_time = now
        for token in token_ids:
            if self.finished:
                break
            self.output_ids.append(token)
            committed += 1
            if token in self._eos_token_ids or token in self._stop_token_ids:
                if self.params.include_stop_str_in_output:  # (vLLM's: the ending token's text too; a
                    self._detokenizer.add([token])  # special token's as skip_special_tokens says)
                self.finish_reason = "stop"
                if token not in self._eos_token_ids:  # (EOS is no stop reason: vLLM checks it first)
                    self.stop_reason = token
            else:
                delta = self._detokenizer.add([token])
                # (stop strings count from min_tokens on, as vLLM's: before, neither they nor EOS end a request)
                if delta and len(self.output_ids) >= self.params.min_tokens and self._find_stop_string(len(delta)):
                    self.finish_reason = "stop"
            if not self.finished and len(self.output_ids) >= self._max_new:
                self.finish_reason = "length"
        self.metrics.num_generated_tokens = len(self.output_ids)
        if self.finished:
            if self._flush():
                self.finish_reason = "stop"
            self.metrics.finish_time = now
        return committed

    def finish(self, reason: str) -> None:
        """End the request from outside (cancelled, say)."""
        if not self.finished:
            self.finish_reason = reason
            self._flush()
            self.metrics.finish_time = time.perf_counter()

    def _flush(self) -> bool:
        """The text held back (an incomplete character) out at the end, checked for stop strings as
        any other; whether one ends in it."""
        flushed = self._detokenizer.flush()
        return (bool(flushed) and self._text_end is None and len(self.output_ids) >= self.params.min_tokens
                and self._find_stop_string(len(flushed)))

    def fail(self, message: str, reason: str) -> None:
        """End the request because something went wrong while computing it (`finish_reason` "error")."""
        if not self.finished:
            self.error, self.error_reason = message, reason
            self.finish("error")

    # --- text -------------------------------------------------------------------------------
    def _find_stop_string(self, delta_length: int) -> bool:
        text = self._detokenizer.text
        for stop in self.params.stop:
            start = max(0, len(text) - delta_length - len(stop) + 1)
            index = text.find(stop, start)
            if index != -1:
                self._text_end = index + (len(stop) if self.params.include_stop_str_in_output else 0)
                self.stop_reason = stop
                return True
        return False

    @property
    def text(self) -> str:
        return self._detokenizer.text[:self._text_end]

    def take_text_delta(self) -> str:
        """Text not yet handed out. While running, text that could be the start of a stop string
        is held back, so a stream never shows what the final text will not contain."""
        finished = self.finished  # (read first: text read after it is never older than it)
        text = self.text
        end = len(text)
        if not finished:
            for stop in self.params.stop:
                for n in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:n]):
                        end = min(end, len(text) - n)
                        break
        delta = text[self._streamed:end]
        self._streamed = max(self._streamed, end)
        return delta

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.text,
                             list(self.output_ids), self.finish_reason, self.metrics, error=self.error,
                             error_reason=self.error_reason,
                             logprobs=None if self.logprobs is None else list(self.logprobs),
                             prompt_logprobs=self.prompt_logprobs, stop_reason=self.stop_reason,
                             num_cached_tokens=self.num_cached_tokens)


class NoText:
    """The detokenizer of a request made with detokenize=False: its tokens make no text."""
    text = ""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def add(self, new_token_ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


def rows_by_method(batch: list[Sequence]) -> dict[str, list[int]]:
    """Row indices of the batch grouped by drafter (plain rows left out)."""
    groups: dict[str, list[int]] = {}
    for b, seq in enumerate(batch):
        if seq.method is not None:
            groups.setdefault(seq.method, []).append(b)
    return groups
