"""One streamed response: server-sent events from a request's outputs, always ending in `[DONE]`.

A request of several samples (n > 1) streams them side by side, each chunk naming its choice's
`index`, the outputs taken as they come. A request that fails while running, or a server that stops
before it finishes, ends the stream with an OpenAI-shaped error event (`data: {"error": {...}}`) and
then `[DONE]`, never a silent cut. A client that goes away has its requests aborted (closing the
output iterators does that).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from draftwise.engine.outputs import RequestOutput
from draftwise.server.async_engine import EngineStopped
from draftwise.server.logprobs import LogprobsFormat
from draftwise.server.metrics import ServerMetrics
from draftwise.server.protocol import error_body
from draftwise.server.responses import DONE, chunk, object_name, sse, usage
from draftwise.server.tools import ToolCallStream

logger = logging.getLogger(__name__)


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
    echoes: tuple[str | None, ...] = (None,)  # per prompt, a completion's prompt text, streamed first
    samples_per_prompt: int = 1  # (a batch's choices: prompt i's are i n ... i n + n - 1)


class ChoiceStream:
    """One choice's chunks: its text (or tool calls) and logprobs as they come, then its finish."""

    def __init__(self, index: int, context: StreamContext) -> None:
        self.index, self.context = index, context
        self.echo = context.echoes[index // context.samples_per_prompt]  # (its prompt's)
        self.calls = ToolCallStream() if context.chat and context.calls_tools else None
        self.listed = 0  # tokens whose logprobs were sent
        self.text_offset = len(self.echo or "")  # characters of the tokens listed (completions' text_offset)

    def opening(self, first: RequestOutput) -> list[dict]:
        """The chunk before any token: chat's role; a completion's echoed prompt (and its logprobs)."""
        context = self.context
        if context.chat:
            return [self._chunk({"role": "assistant", "content": ""})]
        if self.echo:
            listed = None
            if context.logprobs is not None and first.prompt_logprobs is not None:
                listed = context.logprobs.body(first.prompt_logprobs, first.prompt_token_ids)
            return [self._chunk(self.echo, logprobs=listed)]
        return []

    def chunks(self, output: RequestOutput) -> list[dict]:
        context, chat = self.context, self.context.chat
        if not (output.delta or output.finished):
            return []
        if self.calls is not None:
            deltas = self.calls.feed(output.delta, output.finished)
        else:
            deltas = [{"content": output.delta} if chat else output.delta] if output.delta else []
        logprobs = None
        if context.logprobs is not None and output.logprobs is not None and len(output.token_ids) > self.listed:
            logprobs = context.logprobs.body(output.logprobs[self.listed:], output.token_ids[self.listed:],
                                             self.text_offset)
            self.listed = len(output.token_ids)
            if not chat and logprobs["tokens"]:  # (the listed tokens' text, held back or not: as unstreamed)
                self.text_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            deltas = deltas or [{} if chat else ""]  # (a chunk of its own for tokens whose text is held back)
        out = [self._chunk(content, logprobs=logprobs if i == 0 else None) for i, content in enumerate(deltas)]
        if output.finished:
            reason = output.finish_reason
            if self.calls is not None and self.calls.called and reason == "stop":
                reason = "tool_calls"
            last = self._chunk({} if chat else "", reason)
            last["choices"][0]["stop_reason"] = output.stop_reason  # (vLLM's: the stop string or token id)
            out.append(last)
        return out

    def _chunk(self, content, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
        context = self.context
        body = chunk(context.request_id, context.created, context.model, context.chat, content, finish_reason,
                     logprobs)
        body["choices"][0]["index"] = self.index
        return body


async def stream_events(firsts: list[RequestOutput], streams: list[AsyncIterator[RequestOutput]],
                        context: StreamContext, metrics: ServerMetrics) -> AsyncIterator[str]:
    """The events of a request's samples (one, or n side by side), their outputs as they come."""
    choices = [ChoiceStream(i, context) for i in range(len(firsts))]
    finals = list(firsts)
    last_time = time.perf_counter()
    ended = False
    merged = _merged(streams, firsts)
    try:
        for choice, first in zip(choices, firsts):
            for body in choice.opening(first):
                yield sse(body)
        async for index, output in merged:
            finals[index] = output
            if output.finish_reason == "error":
                ended = True
                yield sse(error_body(output.error or "the request failed", "server_error",
                                     code=output.error_reason or "engine_error"))
                yield DONE
                return
            if output.delta or output.finished:
                now_time = time.perf_counter()
                metrics.observe_tokens(output.num_new_tokens, now_time - last_time)
                last_time = now_time
            for body in choices[index].chunks(output):
                yield sse(body)
            # The loop turns once an output: outputs already queued are taken without a pause, and
            # a send to a client that left returns at once, so without it nothing else (the task that
            # hears the disconnect, /health) would run until the request ended.
            await asyncio.sleep(0)
        if context.include_usage:
            yield sse({"id": context.request_id, "object": object_name(context.chat, True),
                       "created": context.created, "model": context.model, "choices": [],
                       "usage": usage(finals[::context.samples_per_prompt], finals)})
        ended = True
        yield DONE
    except EngineStopped as error:
        ended = True
        metrics.observe_aborted("shutdown")
        yield sse(error_body(str(error), "server_error", code="server_shutting_down"))
        yield DONE
    finally:
        await merged.aclose()  # (its pumps stopped and waited for: a stream is closed only when none reads it)
        for stream in streams:
            try:
                await stream.aclose()  # a client gone mid-stream aborts its requests here
            except Exception:  # (one stream's trouble must not cost the others their abort, or the metrics)
                logger.exception("closing a sample's stream failed")
        for final in finals:
            if final.finished:
                metrics.observe_finished(final, context.segment, context.method)
        if not ended and not all(final.finished for final in finals):
            metrics.observe_aborted("client_disconnected")  # (once for the request, as a non-streamed one)


async def _merged(streams: list[AsyncIterator[RequestOutput]],
                  firsts: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(sample index, output) from every stream as they come, each starting with its first output,
    until every sample has finished (or one failed)."""
    if len(streams) == 1:  # (the common case, without tasks)
        output = firsts[0]
        yield 0, output
        while not output.finished:
            output = await anext(streams[0])
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput], output: RequestOutput) -> None:
        try:
            await queue.put((index, output))
            while not output.finished:
                output = await anext(stream)
                await queue.put((index, output))
        except Exception as error:  # (handed to the consumer, which raises it)
            await queue.put((index, error))

    tasks = [asyncio.create_task(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
    try:
        open_samples = len(streams)
        while open_samples:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            yield index, item
            if item.finished:
                open_samples -= 1
                if item.finish_reason == "error":
                    return
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # (a stream still in a pump's `anext` cannot be closed)
