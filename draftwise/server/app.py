"""The FastAPI application: routes, the middleware in front of them, and errors in OpenAI's shape.

Every error is an OpenAI-style body ({"error": {"message", "type", "param", "code"}}): bad JSON,
fields of the wrong type or range, unknown fields, unknown models (404), unknown paths (404) and
methods (405), a body over the limit (413), a bad API key (401), a Host not allowed (400), a
server shutting down (503 with Retry-After), and a request that failed while running (500).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from draftwise.server.async_engine import AsyncEngine
from draftwise.server.handler import RequestHandler
from draftwise.server.metrics import ServerMetrics
from draftwise.server.protocol import error_body
from draftwise.server.requests import RequestError, Served, ServerLimits
from draftwise.server.routes import router
from draftwise.server.security import ApiKeyAuth, BodyLimit, HostAllowlist, api_keys

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerOptions:
    api_key: str | tuple[str, ...] | None = None  # every path but /health needs `Authorization: Bearer KEY`; each key a tenant
    allowed_hosts: frozenset[str] = frozenset({"*"})  # Host header names answered ("*": any)
    allowed_origins: tuple[str, ...] = ()  # CORS origins (none: CORS off)
    limits: ServerLimits = field(default_factory=ServerLimits)
    drain_timeout: float = 30.0  # seconds running requests get to finish at shutdown

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_key", api_keys(self.api_key))  # (one key or several -> a tuple; empty refused)


def build_app(engine: AsyncEngine, model_name: str, options: ServerOptions = ServerOptions()) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        import asyncio

        await asyncio.to_thread(engine.drain, options.drain_timeout)  # finish or end in-flight requests

    app = FastAPI(title="draftwise", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    metrics = ServerMetrics(model_name)
    engine.on_change = metrics.observe_step
    served = Served(frozenset(engine.llm.engine.drafters), engine.llm.default_method)
    app.state.handler = RequestHandler(engine, model_name, metrics, options.limits, served,
                                       max_prompt_chars(engine.llm))
    app.include_router(router)
    _add_error_handlers(app, metrics)
    # Outermost last: the Host check, then CORS (preflights carry no key), the key, the body limit.
    app.add_middleware(BodyLimit, max_bytes=options.limits.max_request_bytes)
    if options.api_key:
        app.add_middleware(ApiKeyAuth, api_keys=options.api_key)
    if options.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(HostAllowlist, allowed=options.allowed_hosts)
    return app


def max_prompt_chars(llm) -> int:
    """Characters beyond which a prompt surely has more tokens than the context holds: a token
    decodes to at most as many characters as its vocabulary entry has (byte-level BPE: one per byte)."""
    longest = max((len(token) for token in llm.tokenizer.id_to_token_list() if token), default=1)
    return llm.max_model_len * longest


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError):
        metrics.observe_failed(error.code or error.kind)
        return JSONResponse(error_body(error.message, error.kind, error.param, error.code), status_code=error.status,
                            headers=error.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(error.status_code,
                                                                                          str(error.detail))
        return JSONResponse(error_body(message, code=code), status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):  # (bodies are parsed in handler.py)
        return JSONResponse(error_body("the request is not valid"), status_code=400)

    @app.exception_handler(Exception)
    async def internal(request: Request, error: Exception):
        logger.exception("unhandled error serving %s", request.url.path, exc_info=error)
        metrics.observe_failed("internal_error")
        return JSONResponse(error_body(f"internal server error: {type(error).__name__}", "server_error",
                                       code="internal_error"), status_code=500)
