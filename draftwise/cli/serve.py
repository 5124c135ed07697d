"""`draftwise serve`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import sys

from draftwise.cli.model_flags import add_model_arguments
from draftwise.cli.speculative_flags import speculative_from_args


def add_parser(commands) -> None:
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    add_model_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    serve.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    serve.add_argument("--max-num-seqs", type=int, default=8, help="requests decoded together")
    serve.add_argument("--max-model-len", type=int, default=4096, help="context length")
    serve.add_argument("--kv-cache-memory-gb", type=float, default=None,
                       help="KV cache budget (default: max-num-seqs x max-model-len tokens)")
    serve.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    import uvicorn

    from draftwise.llm import LLM
    from draftwise.server.app import build_app
    from draftwise.server.async_engine import AsyncEngine

    kv_bytes = int(args.kv_cache_memory_gb * 2**30) if args.kv_cache_memory_gb else None
    llm = LLM(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, kv_cache_memory_bytes=kv_bytes,
              speculative=speculative_from_args(args))
    engine = AsyncEngine(llm)
    app = build_app(engine, args.served_model_name or args.model, api_key=args.api_key)
    print(f"serving {args.model} on http://{args.host}:{args.port}/v1"
          + (f" (speculation: {llm.default_method})" if llm.default_method else ""), file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=10)
