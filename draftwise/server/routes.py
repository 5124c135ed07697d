"""The endpoints: completions, chat completions, models, health and metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from draftwise.server.handler import RequestHandler, parse_body
from draftwise.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from draftwise.server.requests import chat_request, completion_requests
from draftwise.server.responses import now
from draftwise.structured.tool_calls import OPEN

router = APIRouter()


def handler_of(request: Request) -> RequestHandler:
    return request.app.state.handler


@router.get("/health")
async def health(request: Request):
    """200 while serving; 503 while draining for shutdown (so load balancers stop sending)."""
    if not handler_of(request).engine.accepting:
        return JSONResponse(error_body("the server is shutting down", "server_error", code="server_shutting_down"),
                            status_code=503)
    return Response(status_code=200)


@router.get("/metrics")
async def prometheus(request: Request):
    return Response(handler_of(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [{"id": handler_of(request).model_name, "object": "model", "created": now(),
                                        "owned_by": "draftwise"}]}


@router.post("/v1/completions")
async def completions(request: Request):
    handler = handler_of(request)
    body = await parse_body(request, CompletionRequest)
    handler.check_model(body.model)
    return await handler.run(request, body, completion_requests(body, handler.limits, handler.served))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    handler = handler_of(request)
    body = await parse_body(request, ChatCompletionRequest)
    handler.check_model(body.model)  # before any template work
    tokenizer = handler.engine.llm.tokenizer
    tag = tokenizer.token_to_id(OPEN)
    return await handler.run(request, body, [chat_request(body, handler.limits, handler.served, tokenizer.chat_template,
                                                          tag is not None and tag in tokenizer.special_token_ids)])
