"""One streamed response: server-sent events from a request's outputs, always ending in `[DONE]`.

A request that fails while running, or a server that stops before it finishes, ends the stream
with an OpenAI-shaped error event (`data: {"error": {...}}`) and then `[DONE]`, never a silent
cut. A client that goes away has its request aborted (closing the output iterator does that).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from draftwise.engine.outputs import RequestOutput
from draftwise.server.async_engine import EngineStopped
from draftwise.server.metrics import ServerMetrics
from draftwise.server.protocol import error_body
from draftwise.server.responses import DONE, chunk, object_name, sse, usage
from draftwise.server.logprobs import LogprobsFormat
from draftwise.server.tools import ToolCallStream


@dataclass(frozen=True, slots=True)
class StreamContext:
    request_id: str
    created: int
    model: str
    chat: bool
    include_usage: bool
    segment: str
    method: str | None
    calls_tools: bool = False  # the answer may call tools: calls stream as tool_calls deltas
    logprobs: LogprobsFormat | None = None  # the request asked for logprobs: each chunk carries its tokens'
    echo: str | None = None  # a completion's prompt text, streamed first


async def stream_events(first: RequestOutput, outputs: AsyncIterator[RequestOutput], context: StreamContext,
                        metrics: ServerMetrics) -> AsyncIterator[str]:
    chat = context.chat
    last_time = time.perf_counter()
    final = first
    ended = False
    calls = ToolCallStream() if chat and context.calls_tools else None
    listed, text_offset = 0, len(context.echo or "")  # tokens whose logprobs were sent; characters sent
    try:
        if chat:
            yield sse(chunk(context.request_id, context.created, context.model, chat,
                            {"role": "assistant", "content": ""}, None))
        elif context.echo:
            prompt_listed = None
            if context.logprobs is not None and first.prompt_logprobs is not None:  # (the prompt's tokens' first)
                prompt_listed = context.logprobs.body(first.prompt_logprobs, first.prompt_token_ids)
            yield sse(chunk(context.request_id, context.created, context.model, chat, context.echo, None,
                            prompt_listed))
        output = first
        while True:
            if output.finish_reason == "error":
                final, ended = output, True
                yield sse(error_body(output.error or "the request failed", "server_error",
                                     code=output.error_reason or "engine_error"))
                yield DONE
                return
            if output.delta or output.finished:
                now_time = time.perf_counter()
                metrics.observe_tokens(output.num_new_tokens, now_time - last_time)
                last_time = now_time
                if calls is not None:
                    deltas = calls.feed(output.delta, output.finished)
                else:
                    deltas = [{"content": output.delta} if chat else output.delta] if output.delta else []
                logprobs = None
                if context.logprobs is not None and output.logprobs is not None and len(output.token_ids) > listed:
                    logprobs = context.logprobs.body(output.logprobs[listed:], output.token_ids[listed:], text_offset)
                    listed = len(output.token_ids)
                    if not deltas:
                        deltas = [{} if chat else ""]  # (a chunk of its own for tokens whose text is held back)
                for i, content in enumerate(deltas):
                    yield sse(chunk(context.request_id, context.created, context.model, chat, content, None,
                                    logprobs if i == 0 else None))
                text_offset += len(output.delta)
                if output.finished:
                    reason = output.finish_reason
                    if calls is not None and calls.called and reason == "stop":
                        reason = "tool_calls"
                    yield sse(chunk(context.request_id, context.created, context.model, chat, {} if chat else "",
                                    reason))
            final = output
            if output.finished:
                break
            output = await anext(outputs)
        if context.include_usage:
            yield sse({"id": context.request_id, "object": object_name(chat, True), "created": context.created,
                       "model": context.model, "choices": [], "usage": usage(final)})
        ended = True
        yield DONE
    except EngineStopped as error:
        ended = True
        metrics.observe_aborted("shutdown")
        yield sse(error_body(str(error), "server_error", code="server_shutting_down"))
        yield DONE
    finally:
        await outputs.aclose()  # a client gone mid-stream aborts its request here
        if final.finished:
            metrics.observe_finished(final, context.segment, context.method)
        elif not ended:
            metrics.observe_aborted("client_disconnected")
