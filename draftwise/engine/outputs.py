"""What a request returns: text, token ids, why it stopped and how fast it ran."""

from __future__ import annotations

from dataclasses import dataclass

from draftwise.speculative.metrics import SpecMetrics


@dataclass(slots=True)
class RequestMetrics:
    num_prompt_tokens: int
    num_generated_tokens: int
    arrival_time: float  # time.perf_counter() seconds
    first_token_time: float | None
    finish_time: float | None
    spec: SpecMetrics | None = None  # speculation counters, when the request was speculated
    num_preemptions: int = 0  # times the request was sent back to the queue for lack of KV blocks

    @property
    def seconds(self) -> float:
        """Wall time from arrival to the last token."""
        return (self.finish_time or self.arrival_time) - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens over the whole request time (prefill included)."""
        return self.num_generated_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first, over the time after the first (the decode rate)."""
        if self.first_token_time is None or self.finish_time is None or self.num_generated_tokens < 2:
            return 0.0
        elapsed = self.finish_time - self.first_token_time
        return (self.num_generated_tokens - 1) / elapsed if elapsed > 0 else 0.0

    def summary(self) -> str:
        ttft = self.time_to_first_token
        text = (f"{self.num_generated_tokens} tokens in {self.seconds:.2f} s "
                f"({self.tokens_per_second:.2f} tok/s; decode {self.decode_tokens_per_second:.2f} tok/s; "
                f"prompt {self.num_prompt_tokens} tokens, first token after {ttft or 0:.2f} s)")
        return text + (f"; {self.spec.summary()}" if self.spec is not None and self.spec.num_drafts else "")


@dataclass(frozen=True, slots=True)
class Logprob:
    """vLLM's shape: a token's log-probability under the model (its raw logits' log-softmax, before
    penalties, grammars and temperature), its rank among all tokens (1: the most likely) and its text
    decoded alone (special tokens as written; part of a character as U+FFFD, as vLLM shows it)."""
    logprob: float
    rank: int
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob, for the generated token and the top N.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, stop string or stop token), "length", "error", or None while running
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None  # the sum of its tokens' logprobs (best_of ranks by it)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: EOS, length)

    def finished(self) -> bool:
        """vLLM's: whether it has ended."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    error: str | None = None  # set when finish_reason is "error": what went wrong (other requests are unharmed)
    error_reason: str | None = None  # a short label of the failure ("engine_error", "kv_cache_full")
    delta: str = ""  # from LLM.step: text new since the previous output (stop-string safe)
    num_new_tokens: int = 0  # from LLM.step: tokens new since the previous output
    logprobs: SampleLogprobs | None = None  # with SamplingParams(logprobs=N): one dict per generated token
    completions: list[CompletionOutput] | None = None  # with n > 1: every sample (this output is the first)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # with SamplingParams(prompt_logprobs=N)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: EOS, length)
    num_cached_tokens: int | None = None  # vLLM's: prompt tokens the prefix cache held when it first ran

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape: the request's completions (one unless n > 1)."""
        if self.completions is not None:
            return self.completions
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.logprobs,
                                 cumulative_logprob(self.token_ids, self.logprobs), self.stop_reason)]


def cumulative_logprob(token_ids: list[int], logprobs: SampleLogprobs | None) -> float | None:
    """The sum of the sampled tokens' logprobs (None without logprobs), vLLM's `cumulative_logprob`."""
    if logprobs is None:
        return None
    return sum(entry[token].logprob for token, entry in zip(token_ids, logprobs))
