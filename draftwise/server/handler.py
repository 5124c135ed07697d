"""Serving one request: parse its body, map it, tokenize it off the event loop, run it on the
engine, and answer with a body or a stream. Every failure becomes a `RequestError` (an HTTP status
and an OpenAI-shaped error); nothing here ever answers with a traceback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from draftwise.engine.outputs import RequestOutput
from draftwise.errors import DraftwiseError, InvalidParameterError, PromptTooLongError
from draftwise.server.async_engine import AsyncEngine, EngineDraining, EngineStopped
from draftwise.server.metrics import ServerMetrics
from draftwise.server.protocol import SamplingFields
from draftwise.server.requests import EngineRequest, RequestError, Served, ServerLimits
from draftwise.llm.samples import gathered, per_sample, sample_count
from draftwise.server.logprobs import LogprobsFormat
from draftwise.server.responses import new_id, now, response_body
from draftwise.server.streaming import StreamContext, stream_events

RETRY_AFTER_SECONDS = 5
DISCONNECT_POLL_SECONDS = 0.1  # how often a request waiting for its samples' first tokens looks for its client
CLIENT_CLOSED_REQUEST = 499  # (nginx's status for a client that left: nobody reads it)
# a request that failed while running: 500 unless listed (a constraint its own fields exclude: its fault)
FAILED_STATUS = {"kv_cache_full": 503, "constraint_unsatisfiable": 400}


@dataclass(slots=True)
class RequestHandler:
    engine: AsyncEngine
    model_name: str
    metrics: ServerMetrics
    limits: ServerLimits
    served: Served
    max_prompt_chars: int  # a prompt longer than this cannot fit the context, whatever its tokens

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise RequestError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                               "model", "model_not_found")

    async def run(self, request: Request, body: SamplingFields, engine_requests: list[EngineRequest]):
        """Answer a request: one prompt (`engine_requests` of one), or a completions batch (a request
        per prompt, answered together: prompt i's samples are choices i n ... i n + n - 1)."""
        for engine_request in engine_requests:
            engine_request.options["tenant"] = getattr(request.state, "tenant", None)  # (ApiKeyAuth's: the key's tenant)
        # (the tokenizer releases the GIL)
        prompts = await asyncio.to_thread(lambda: [self._tokenize(one) for one in engine_requests])
        if body.cache_salt is not None:
            for prompt in prompts:
                prompt["cache_salt"] = body.cache_salt
        engine_request, prompt = engine_requests[0], prompts[0]
        if len(engine_requests) > 1 or sample_count(engine_request.params) > 1:
            return await self._run_samples(request, body, engine_requests, prompts)
        outputs = self.engine.generate(prompt, engine_request.params, **engine_request.options)
        first = await self._first_output(outputs, engine_request.prompt_param)
        prefix = "chatcmpl" if engine_request.chat else "cmpl"
        logprobs = self._logprobs_format(engine_request)
        echo = self._echo(engine_request, prompt)
        context = StreamContext(new_id(prefix), now(), self.model_name, engine_request.chat, body.include_usage,
                                self.metrics.segment(body.segment), engine_request.method, engine_request.calls_tools,
                                logprobs, (echo,))
        if body.stream:
            return StreamingResponse(stream_events([first], [outputs], context, self.metrics),
                                     media_type="text/event-stream")
        final = await self._counting_a_disconnect(self._last_output(request, first, outputs))
        if final.finish_reason == "error":
            raise RequestError(FAILED_STATUS.get(final.error_reason, 500), final.error or "the request failed",
                               kind="server_error", code=final.error_reason or "engine_error")
        self.metrics.observe_finished(final, context.segment, context.method)
        return JSONResponse(response_body([final], context.request_id, context.created, self.model_name,
                                          engine_request.chat, engine_request.calls_tools, logprobs, [echo]))

    async def _run_samples(self, request: Request, body: SamplingFields, engine_requests: list[EngineRequest],
                           prompts: list[dict]) -> JSONResponse:
        """n > 1, best_of or a batch of prompts: each sample of each prompt a request of its own (a
        prompt's samples sharing its KV blocks through the prefix cache), gathered into one answer, or
        streamed side by side (each chunk naming its choice's index; best_of cannot stream: the best
        are known only at the end)."""
        first_request = engine_requests[0]
        params = first_request.params
        count = sample_count(params)
        if body.stream and count > params.n:
            raise RequestError(400, "best_of above n cannot stream (the best samples are known only when all "
                               "have finished)", "best_of", "unsupported_parameter")
        streams = [self.engine.generate(prompt, sample, **engine_request.options)
                   for engine_request, prompt in zip(engine_requests, prompts) for sample in per_sample(params)]
        firsts = await self._first_outputs(request, streams, first_request.prompt_param)
        echoes = [self._echo(engine_request, prompt) for engine_request, prompt in zip(engine_requests, prompts)]
        prefix = "chatcmpl" if first_request.chat else "cmpl"
        if body.stream:
            context = StreamContext(new_id(prefix), now(), self.model_name, first_request.chat, body.include_usage,
                                    self.metrics.segment(body.segment), first_request.method,
                                    first_request.calls_tools, self._logprobs_format(first_request), tuple(echoes),
                                    count)
            return StreamingResponse(stream_events(firsts, streams, context, self.metrics),
                                     media_type="text/event-stream")
        endings = await self._last_outputs(request, firsts, streams)
        error = next((ending for ending in endings if isinstance(ending, Exception)), None)
        if error is not None:
            if isinstance(error, RequestError) and error.status == CLIENT_CLOSED_REQUEST:
                self.metrics.observe_aborted("client_disconnected")  # (once for the request)
            raise error
        finals = endings
        failed = next((final for final in finals if final.finish_reason == "error"), None)
        if failed is not None:
            raise RequestError(FAILED_STATUS.get(failed.error_reason, 500), failed.error or "the request failed",
                               kind="server_error", code=failed.error_reason or "engine_error")
        segment = self.metrics.segment(body.segment)
        for final in finals:
            self.metrics.observe_finished(final, segment, first_request.method)
        outputs = [gathered(list(finals[i:i + count]), params) for i in range(0, len(finals), count)]
        return JSONResponse(response_body(outputs, new_id(prefix), now(), self.model_name, first_request.chat,
                                          first_request.calls_tools, self._logprobs_format(first_request), echoes,
                                          samples=list(finals)))

    def _echo(self, engine_request: EngineRequest, prompt: dict) -> str | None:
        """A completion's prompt text, where its answer starts with it (`echo`); else None."""
        if not engine_request.echo:
            return None
        return prompt["prompt"] or self.engine.llm.tokenizer.decode(prompt["prompt_token_ids"])

    def _logprobs_format(self, request: EngineRequest) -> LogprobsFormat | None:
        params = request.params
        if params.logprobs is None:
            return None
        tokenizer = self.engine.llm.tokenizer
        end_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else tokenizer.eos_token_ids)
        return LogprobsFormat(tokenizer, params.logprobs, request.chat, end_ids)

    def _tokenize(self, request: EngineRequest) -> dict:
        """The prompt as token ids (a chat through its template), its length checked first; and the
        output constraint compiled (cached), so that the engine thread never waits for a compile."""
        if request.num_prompt_chars > self.max_prompt_chars:
            raise RequestError(400, f"the prompt has {request.num_prompt_chars} characters: more tokens than "
                               f"this model's context holds", request.prompt_param,
                               "context_length_exceeded")
        tokenizer = self.engine.llm.tokenizer
        constraint = request.params.structured_outputs
        if constraint is not None:
            try:
                self.engine.llm.grammars.compile(constraint)
            except DraftwiseError as error:
                raise RequestError(400, str(error), request.constraint_param) from None
        try:
            if request.chat:
                # (text never forges control tokens)
                ids = tokenizer.encode_chat(request.messages, tools=request.tools, **request.chat_options)
            elif request.fim_suffix is not None:
                try:
                    ids = tokenizer.fim_prompt(request.text, request.fim_suffix)
                except InvalidParameterError:
                    raise RequestError(400, f"model {self.model_name!r} has no fill-in-the-middle tokens "
                                       "(<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>): suffix is not served",
                                       "suffix", "unsupported_parameter") from None
            elif request.text is not None:
                ids = tokenizer.encode(request.text)
            else:
                ids = request.token_ids
        except DraftwiseError as error:  # a chat template that refused the conversation
            raise RequestError(400, str(error), request.prompt_param) from None
        return {"prompt_token_ids": ids, "prompt": request.text or ""}

    async def _first_output(self, outputs: AsyncIterator[RequestOutput], prompt_param: str) -> RequestOutput:
        """The request's first output; refusals (bad input, a full server, shutdown) surface here,
        before any response starts. prompt_param: where the prompt was ("prompt", "messages")."""
        try:
            return await anext(outputs)
        except PromptTooLongError as error:
            raise RequestError(400, str(error), prompt_param, "context_length_exceeded") from None
        except EngineDraining as error:
            raise RequestError(503, str(error), kind="server_error", code="server_shutting_down",
                               headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except EngineStopped as error:
            raise RequestError(503, str(error), kind="server_error", code="server_shutting_down") from None
        except DraftwiseError as error:
            raise RequestError(400, str(error)) from None

    async def _first_outputs(self, request: Request, streams: list, prompt_param: str) -> list[RequestOutput]:
        """Every sample's first output, the samples admitted together (one after another, a later one
        waited for an earlier one's first token, and for a free row); if the client goes away
        meanwhile or one sample is refused, every sample is aborted."""
        tasks = [asyncio.ensure_future(self._first_output(stream, prompt_param)) for stream in streams]
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, timeout=DISCONNECT_POLL_SECONDS,
                                                   return_when=asyncio.FIRST_EXCEPTION)
                failed = next((task for task in done if task.exception() is not None), None)
                if failed is not None:
                    raise failed.exception()
                if pending and await request.is_disconnected():
                    self.metrics.observe_aborted("client_disconnected")
                    raise RequestError(CLIENT_CLOSED_REQUEST, "the client went away before the answer began")
            return [task.result() for task in tasks]
        except BaseException:
            for task in tasks:
                task.cancel()  # (a sample cancelled while it waits posts its own abort)
            await asyncio.gather(*tasks, return_exceptions=True)
            for stream in streams:
                await stream.aclose()  # (a sample that had begun is aborted)
            raise

    async def _last_outputs(self, request: Request, firsts: list[RequestOutput], streams: list) -> list:
        """Every sample run to its end, each ending a final output or the exception it raised; once one
        fails (an exception, or an output that ended in error) the others are aborted at once: the
        answer is an error whatever they would say, and their rows are wanted elsewhere."""
        tasks = [asyncio.ensure_future(self._last_output(request, first, stream))
                 for first, stream in zip(firsts, streams)]
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(task.exception() is not None or task.result().finish_reason == "error" for task in done):
                    break
        finally:
            for task in tasks:
                task.cancel()  # (a sample cancelled while it runs is aborted: `_last_output` closes its stream)
            endings = await asyncio.gather(*tasks, return_exceptions=True)
        return endings

    async def _counting_a_disconnect(self, awaitable):
        """Await a non-streamed request's end; a client that went away is counted as such (and not
        as a finished request: its partial answer is nobody's)."""
        try:
            return await awaitable
        except RequestError as error:
            if error.status == CLIENT_CLOSED_REQUEST:
                self.metrics.observe_aborted("client_disconnected")
            raise

    async def _last_output(self, request: Request, first: RequestOutput,
                           outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
        """Run a non-streamed request to its end (aborted, RequestError CLIENT_CLOSED_REQUEST, if its
        client goes away)."""
        final = first
        try:
            while not final.finished:
                final = await anext(outputs)
                if not final.finished and await request.is_disconnected():
                    raise RequestError(CLIENT_CLOSED_REQUEST, "the client went away before the answer was complete")
        except EngineStopped as error:
            self.metrics.observe_aborted("shutdown")
            raise RequestError(503, str(error), kind="server_error", code="server_shutting_down") from None
        finally:
            await outputs.aclose()
        return final


LARGE_BODY_BYTES = 64 * 1024  # bodies past this are parsed on a worker thread, not the event loop


async def parse_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The body validated strictly (the raw JSON parser: lone surrogates are refused); a failure is
    a 400 naming the field, without echoing the input. A large body is parsed off the event loop
    (megabytes of JSON take tens of milliseconds, which /health and the streams must not wait for)."""
    raw = await request.body()
    try:
        if len(raw) > LARGE_BODY_BYTES:
            return await asyncio.to_thread(model.model_validate_json, raw)
        return model.model_validate_json(raw)
    except ValidationError as error:
        raise describe(error) from None


def describe(error: ValidationError) -> RequestError:
    first = error.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        if "hex escape" in detail:  # (what the parser says of a lone surrogate, which is valid JSON syntax)
            detail += " (a \\uD800-\\uDFFF escape must be half of a surrogate pair: a lone one is not text)"
        return RequestError(400, f"the request body is not valid JSON{': ' + detail if detail else ''}")
    location = ".".join(str(part) for part in first["loc"] if not _is_type_tag(part))
    if first["type"] == "extra_forbidden":
        return RequestError(400, f"unknown field {location!r}: not a field of this endpoint (OpenAI's, or draftwise's "
                            "extensions)", location, "unknown_parameter")
    if first["type"] == "missing":
        return RequestError(400, f"{location} is required", location)
    return RequestError(400, f"{location or 'body'}: {first['msg']}", location or None)


def _is_type_tag(part) -> bool:
    """pydantic names a union's member in an error's location ("str", "list[int]"): not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict") or "[" in part
                                      or part.startswith(("function-", "constrained-")))
