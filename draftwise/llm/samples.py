"""Several samples of one prompt (`n`, `best_of`): each runs as a request of its own, sharing the
prompt's KV blocks through the prefix cache (the first to be prefilled registers them), and the
results are gathered into one output, vLLM's shape (`RequestOutput.outputs`)."""

from __future__ import annotations

from dataclasses import replace

from draftwise.engine.outputs import CompletionOutput, RequestOutput, cumulative_logprob
from draftwise.sampling.params import SamplingParams


def sample_count(params: SamplingParams) -> int:
    return params.best_of or params.n


def per_sample(params: SamplingParams) -> list[SamplingParams]:
    """Each sample's parameters: one sample each; a seeded request's j-th sample seeded seed + j (the
    same seed would draw the same tokens); where best_of ranks samples, their logprobs are kept."""
    count = sample_count(params)
    if count == 1:
        return [params]
    logprobs = params.logprobs if params.logprobs is not None or count == params.n else 0
    return [replace(params, n=1, best_of=None, logprobs=logprobs,
                    seed=None if params.seed is None else _wrap(params.seed + j)) for j in range(count)]


def gathered(outputs: list[RequestOutput], params: SamplingParams) -> RequestOutput:
    """One output for a prompt's samples: the n returned (by best_of, the n with the highest
    cumulative logprob, best first), the first of them as the output's own fields."""
    if len(outputs) == 1 and params.n == 1:
        return outputs[0]
    scored = [(output, _cumulative(output)) for output in outputs]
    if len(outputs) > params.n:
        scored.sort(key=lambda item: -(item[1] if item[1] is not None else float("-inf")))
    chosen = scored[:params.n]
    completions = [CompletionOutput(i, o.text, o.token_ids, o.finish_reason,
                                    o.logprobs if params.logprobs is not None else None, score, o.stop_reason)
                   for i, (o, score) in enumerate(chosen)]
    first = chosen[0][0]
    return replace(first, logprobs=completions[0].logprobs, completions=completions)


def _cumulative(output: RequestOutput) -> float | None:
    return cumulative_logprob(output.token_ids, output.logprobs)


def _wrap(seed: int) -> int:
    return seed if seed < 2 ** 64 else seed - 2 ** 64
