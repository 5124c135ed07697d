"""`draftwise serve`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import os
import sys

from draftwise.cli.model_flags import add_model_arguments, model_keywords
from draftwise.cli.speculative_flags import speculative_from_args
from draftwise.errors import InvalidParameterError

API_KEY_ENV = "DRAFTWISE_API_KEY"


def add_parser(commands) -> None:
    from draftwise.server.requests import DEFAULT_MAX_REQUEST_BYTES

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    add_model_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help=f"require 'Authorization: Bearer KEY' on all but /health (or set {API_KEY_ENV})")
    serve.add_argument("--allowed-hosts", default=None,
                       help="comma-separated Host names answered (default: loopback names when bound to loopback, "
                            "else any; '*': any)")
    serve.add_argument("--allowed-origins", default=None, help="comma-separated CORS origins (default: CORS off)")
    serve.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    serve.add_argument("--max-num-seqs", type=int, default=8, help="requests decoded together")
    serve.add_argument("--max-model-len", type=int, default=4096, help="context length")
    serve.add_argument("--kv-cache-memory-gb", type=float, default=None,
                       help="KV cache budget (default: max-num-seqs x max-model-len tokens)")
    serve.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help="larger request bodies get 413")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds running requests get to finish after SIGTERM")
    serve.add_argument("--per-request-methods", default=None,
                       help="comma-separated drafters a request may name, built at start-up (default: every drafter "
                            "that needs no model of its own; '' for none)")
    serve.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from draftwise.llm import LLM
    from draftwise.server.app import ServerOptions, build_app
    from draftwise.server.async_engine import AsyncEngine
    from draftwise.server.requests import ServerLimits
    from draftwise.server.security import default_allowed_hosts
    from draftwise.server.serving import serve
    from draftwise.speculative.registry import all_specs

    if args.max_request_bytes < 1024 or args.drain_timeout < 0:
        raise InvalidParameterError("--max-request-bytes must be at least 1024 and --drain-timeout >= 0")
    kv_bytes = int(args.kv_cache_memory_gb * 2**30) if args.kv_cache_memory_gb else None
    llm = LLM(args.model, **model_keywords(args),
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, kv_cache_memory_bytes=kv_bytes,
              speculative=speculative_from_args(args))
    methods = ([spec.name for spec in all_specs() if spec.per_request] if args.per_request_methods is None
               else [m for m in args.per_request_methods.split(",") if m])
    for method in methods:  # built (and their costs measured) now: no request waits for a build
        try:
            llm.prepare_drafter(method)
        except InvalidParameterError as error:
            if args.per_request_methods is not None:
                raise  # asked for by name: it must be there
            print(f"per-request drafter {method!r} not offered: {error}", file=sys.stderr, flush=True)
    hosts = (frozenset(h.strip() for h in args.allowed_hosts.split(",") if h.strip()) if args.allowed_hosts
             else default_allowed_hosts(args.host))
    origins = tuple(o.strip() for o in (args.allowed_origins or "").split(",") if o.strip())
    options = ServerOptions(args.api_key or os.environ.get(API_KEY_ENV) or None, hosts, origins,
                            ServerLimits(max_request_bytes=args.max_request_bytes), args.drain_timeout)
    engine = AsyncEngine(llm)
    app = build_app(engine, args.served_model_name or args.model, options)
    print(f"serving {args.model} on http://{args.host}:{args.port}/v1"
          + (f" (speculation: {llm.default_method})" if llm.default_method else "")
          + (f"; per-request drafters: {', '.join(sorted(llm.engine.drafters))}" if llm.engine.drafters else ""),
          file=sys.stderr, flush=True)
    serve(app, engine, args.host, args.port, args.drain_timeout)
