"""Response bodies and stream chunks in OpenAI's shapes, and server-sent events."""

from __future__ import annotations

import json
import time
import uuid

from draftwise.engine.outputs import RequestOutput
from draftwise.server.logprobs import LogprobsFormat
from draftwise.speculative.metrics import SpecMetrics
from draftwise.server.tools import answer_message


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def object_name(chat: bool, streaming: bool) -> str:
    if chat:
        return "chat.completion.chunk" if streaming else "chat.completion"
    return "text_completion"


def chunk(request_id: str, created: int, model: str, chat: bool, content, finish_reason: str | None,
          logprobs: dict | None = None) -> dict:
    choice = ({"index": 0, "delta": content, "finish_reason": finish_reason, "logprobs": logprobs} if chat
              else {"index": 0, "text": content, "finish_reason": finish_reason, "logprobs": logprobs})
    return {"id": request_id, "object": object_name(chat, True), "created": created, "model": model,
            "choices": [choice]}


def response_body(outputs: list[RequestOutput], request_id: str, created: int, model: str, chat: bool,
                  calls_tools: bool = False, logprobs: LogprobsFormat | None = None,
                  echoes: list[str | None] | None = None, samples: list[RequestOutput] | None = None) -> dict:
    """The answer to a request: one output per prompt (a completions batch has several, prompt i's
    choices following prompt i - 1's), each with its samples (n > 1: `outputs`' completions).
    calls_tools: the answer may call tools; its calls become the message's `tool_calls`.
    logprobs: how the request asked for its logprobs (None: it did not). echoes: per prompt, a
    completion's prompt text, put before its answers. `samples`: every sample generated (best_of's
    too), counted in the usage (None: the outputs are the samples)."""
    choices = []
    for output, echo in zip(outputs, echoes or [None] * len(outputs)):
        first_index = len(choices)
        for completion in output.outputs:
            entries, token_ids = completion.logprobs, completion.token_ids
            if echo is not None and entries is not None and output.prompt_logprobs is not None:  # (the prompt's first)
                entries, token_ids = output.prompt_logprobs + entries, output.prompt_token_ids + token_ids
            listed = None if logprobs is None or entries is None else logprobs.body(entries, token_ids)
            index = first_index + completion.index
            if not chat:
                choice = {"index": index, "text": (echo or "") + completion.text,
                          "finish_reason": completion.finish_reason, "logprobs": listed,
                          "stop_reason": completion.stop_reason}
                if output.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(output.prompt_logprobs)
                choices.append(choice)
                continue
            message, called = answer_message(completion.text) if calls_tools else ({"role": "assistant",
                                                                                     "content": completion.text}, False)
            finish_reason = "tool_calls" if called and completion.finish_reason == "stop" else completion.finish_reason
            choices.append({"index": index, "message": message, "finish_reason": finish_reason, "logprobs": listed,
                            "stop_reason": completion.stop_reason})
    body = {"id": request_id, "object": object_name(chat, False), "created": created, "model": model,
            "choices": choices, "usage": usage(outputs, samples)}
    if chat and outputs[0].prompt_logprobs is not None:  # (vLLM's chat answer carries them beside its choices)
        body["prompt_logprobs"] = vllm_prompt_logprobs(outputs[0].prompt_logprobs)
    return body


def vllm_prompt_logprobs(entries: list) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a choice: per prompt token None (the first) or {token id: {logprob, rank}}."""
    return [None if entry is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank} for t, lp in entry.items()}
            for entry in entries]


def usage(prompts: list[RequestOutput], samples: list[RequestOutput] | None = None) -> dict:
    """Token counts (each prompt once, by an output of it; every sample's generated tokens; samples
    None: the prompts' outputs are the samples), and speculation's over every sample."""
    samples = samples or prompts
    prompt_tokens = sum(output.metrics.num_prompt_tokens for output in prompts)
    generated = sum(sample.metrics.num_generated_tokens for sample in samples)
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated,
            "prompt_tokens_details": {"cached_tokens": sum(output.num_cached_tokens or 0 for output in prompts)}}
    spec = SpecMetrics()
    for sample in samples:
        if sample.metrics.spec is not None:
            spec.merge(sample.metrics.spec)
    if spec.num_drafts or spec.num_plain_steps:
        body["speculation"] = {"num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
                               "num_accepted_tokens": spec.num_accepted_tokens,
                               "acceptance_rate": round(spec.acceptance_rate, 4),
                               "mean_acceptance_length": round(spec.mean_acceptance_length, 4),
                               "mean_acceptance_length_counts_bonus_token": True}
    return body


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
