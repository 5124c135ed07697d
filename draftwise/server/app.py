"""The HTTP API: OpenAI's completions, chat completions and models endpoints, health and metrics.

Every error is an OpenAI-style body ({"error": {"message", "type", "param", "code"}}) with a 4xx
status: malformed JSON, fields of the wrong type or range, unknown models, prompts longer than the
context. With an API key, every endpoint but /health needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from draftwise.engine.outputs import RequestOutput
from draftwise.errors import DraftwiseError, InvalidParameterError, PromptTooLongError
from draftwise.sampling.params import SamplingParams
from draftwise.server.async_engine import AsyncEngine, EngineStopped
from draftwise.server.metrics import ServerMetrics
from draftwise.server.protocol import (ChatCompletionRequest, CompletionRequest, SamplingFields, error_body,
                                       new_id, now)


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, kind, param, code)


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              shutdown_grace_seconds: float = 10.0) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(engine.shutdown, shutdown_grace_seconds)  # finish or end in-flight requests

    app = FastAPI(title="draftwise", docs_url=None, redoc_url=None, lifespan=lifespan)
    metrics = ServerMetrics(model_name)
    engine.on_step = lambda outputs: metrics.observe_step(engine.llm.engine_stats())
    app.state.engine, app.state.metrics = engine, metrics

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if api_key is not None and request.url.path != "/health":
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return JSONResponse(error_body("invalid or missing API key", "authentication_error",
                                               code="invalid_api_key"), status_code=401)
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return JSONResponse(error.body, status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body("request body is not valid JSON"), status_code=400)
        message = f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(error_body(message, param=".".join(location) or None), status_code=400)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": now(),
                                            "owned_by": "draftwise"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await serve(body, body.prompt_text, "cmpl", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt = engine.llm.tokenizer.apply_chat_template(conversation)
        return await serve(body, prompt, "chatcmpl", chat=True)

    async def serve(body: SamplingFields, prompt: str, prefix: str, chat: bool):
        if body.model != model_name:
            raise ApiError(404, f"model {body.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        params, options = request_options(body, chat)
        segment = metrics.segment(body.segment)
        outputs = engine.generate(prompt, params, **options)
        first = await first_output(outputs)  # errors surface here, before any response starts
        request_id, created = new_id(prefix), now()
        method = speculation_method(options.get("speculative"), engine.llm.default_method)
        if body.stream:
            events = stream_events(first, outputs, body, request_id, created, chat, segment, method)
            return StreamingResponse(events, media_type="text/event-stream")
        final = first
        async for output in outputs:
            final = output
        metrics.observe_finished(final, segment, method)
        return response_body(final, request_id, created, chat)

    def request_options(body: SamplingFields, chat: bool) -> tuple[SamplingParams, dict]:
        limit = body.token_limit if chat else body.max_tokens
        try:
            params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                    seed=body.seed, max_tokens=limit if limit is not None else (None if chat else 16),
                                    stop=body.stop, ignore_eos=body.ignore_eos)
        except InvalidParameterError as error:
            raise ApiError(400, str(error)) from None
        options = {"max_tokens_must_fit": True, "segment": body.segment}
        if body.speculative is not None:
            spec = body.speculative
            options["speculative"] = ({"enabled": False} if not spec.enabled or spec.num_speculative_tokens == 0
                                      else spec.model_dump(exclude_none=True))
        return params, options

    async def first_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
        try:
            return await anext(outputs)
        except PromptTooLongError as error:
            raise ApiError(400, str(error), param="prompt", code="context_length_exceeded") from None
        except EngineStopped as error:
            raise ApiError(503, str(error), kind="server_error") from None
        except DraftwiseError as error:
            raise ApiError(400, str(error)) from None

    async def stream_events(first: RequestOutput, outputs: AsyncIterator[RequestOutput], body: SamplingFields,
                            request_id: str, created: int, chat: bool, segment: str, method: str | None):
        last_time = time.perf_counter()
        final = first
        try:
            if chat:
                yield sse(chunk(request_id, created, chat, {"role": "assistant", "content": ""}, None))
            output = first
            while True:
                if output.delta or output.finished:
                    now_time = time.perf_counter()
                    metrics.observe_tokens(output.num_new_tokens, now_time - last_time)
                    last_time = now_time
                    content = {"content": output.delta} if chat else output.delta
                    if output.delta:
                        yield sse(chunk(request_id, created, chat, content, None))
                    if output.finished:
                        yield sse(chunk(request_id, created, chat, {} if chat else "", output.finish_reason))
                final = output
                if output.finished:
                    break
                output = await anext(outputs)
            if body.include_usage:
                yield sse({"id": request_id, "object": object_name(chat, True), "created": created,
                           "model": model_name, "choices": [], "usage": usage(final)})
            yield "data: [DONE]\n\n"
        except EngineStopped as error:
            yield sse(error_body(str(error), "server_error"))
            yield "data: [DONE]\n\n"
        finally:
            await outputs.aclose()  # a client gone mid-stream aborts its request here
            if final.finished:
                metrics.observe_finished(final, segment, method)

    def chunk(request_id: str, created: int, chat: bool, content, finish_reason: str | None) -> dict:
        choice = ({"index": 0, "delta": content, "finish_reason": finish_reason, "logprobs": None} if chat
                  else {"index": 0, "text": content, "finish_reason": finish_reason, "logprobs": None})
        return {"id": request_id, "object": object_name(chat, True), "created": created, "model": model_name,
                "choices": [choice]}

    def response_body(output: RequestOutput, request_id: str, created: int, chat: bool) -> dict:
        choice = ({"index": 0, "message": {"role": "assistant", "content": output.text},
                   "finish_reason": output.finish_reason, "logprobs": None} if chat
                  else {"index": 0, "text": output.text, "finish_reason": output.finish_reason, "logprobs": None})
        return {"id": request_id, "object": object_name(chat, False), "created": created, "model": model_name,
                "choices": [choice], "usage": usage(output)}

    return app


def speculation_method(speculative: dict | None, default: str | None) -> str | None:
    """The drafter a request runs with, for metrics labels (None: plain decoding)."""
    if speculative is None:
        return default
    if speculative.get("enabled", True) is False:
        return None
    return speculative.get("method") or default


def object_name(chat: bool, streaming: bool) -> str:
    if chat:
        return "chat.completion.chunk" if streaming else "chat.completion"
    return "text_completion"


def usage(output: RequestOutput) -> dict:
    metrics = output.metrics
    body = {"prompt_tokens": metrics.num_prompt_tokens, "completion_tokens": metrics.num_generated_tokens,
            "total_tokens": metrics.num_prompt_tokens + metrics.num_generated_tokens}
    spec = metrics.spec
    if spec is not None and (spec.num_drafts or spec.num_plain_steps):
        body["speculation"] = {"num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
                               "num_accepted_tokens": spec.num_accepted_tokens,
                               "acceptance_rate": round(spec.acceptance_rate, 4),
                               "mean_acceptance_length": round(spec.mean_acceptance_length, 4),
                               "mean_acceptance_length_counts_bonus_token": True}
    return body


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
