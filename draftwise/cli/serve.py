"""`draftwise serve`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import os
import sys

from draftwise.cli.model_flags import add_model_arguments, model_keywords
from draftwise.cli.speculative_flags import given_options, options_for, speculative_from_args
from draftwise.errors import InvalidParameterError

API_KEY_ENV = "DRAFTWISE_API_KEY"


def add_parser(commands) -> None:
    from draftwise.server import DEFAULT_MAX_REQUEST_BYTES  # (not the request models: a parser needs no pydantic)

    # (no abbreviated flags: --replicas hands the replicas every flag but the ingress's, by exact name)
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)",
                                allow_abbrev=False)
    add_model_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", action="append", default=None,
                       help=f"require 'Authorization: Bearer KEY' on all but /health (or set {API_KEY_ENV}); "
                            "repeat it for several keys: each is a tenant, whose text never shapes another's drafts")
    serve.add_argument("--allowed-hosts", default=None,
                       help="comma-separated Host names answered (default: loopback names when bound to loopback, "
                            "else any; '*': any)")
    serve.add_argument("--allowed-origins", default=None, help="comma-separated CORS origins (default: CORS off)")
    serve.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    serve.add_argument("--max-num-seqs", type=int, default=8, help="requests decoded together")
    serve.add_argument("--chat-template", default=None,
                       help="render chats with this template instead of the model's (a Jinja file's path, or the "
                            "template itself on one line; vLLM's flag)")
    serve.add_argument("--seed", type=int, default=None,
                       help="seed of the engine's random stream (vLLM's --seed): requests without a seed of their own "
                            "draw from it, so the same requests in the same order give the same tokens again")
    serve.add_argument("--max-model-len", type=int, default=None,
                       help="context length (default: 4096, or the model's if fewer)")
    serve.add_argument("--kv-cache-memory-gb", type=float, default=None,
                       help="KV cache budget (default: max-num-seqs x max-model-len tokens)")
    serve.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help="larger request bodies get 413")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds running requests get to finish after SIGTERM")
    serve.add_argument("--per-request-methods", default=None,
                       help="comma-separated drafters a request may name, built at start-up (default: every drafter "
                            "that needs no model of its own; '' for none)")
    scale = serve.add_argument_group("scale-out on Ray Serve (README: 'Replicas on Ray Serve')")
    scale.add_argument("--replicas", type=int, default=None,
                       help="N engine replicas on a Ray cluster behind one endpoint (default: one engine in this process)")
    scale.add_argument("--threads-per-replica", type=int, default=1, help="compute threads (and Ray CPUs) of each replica")
    scale.add_argument("--address", default=None,
                       help="an existing Ray cluster ('auto', or ray://host:port); default: start a local one")
    scale.add_argument("--routing", default="affinity", choices=("affinity", "least_loaded", "random"),
                       help="affinity: a conversation / shared prompt keeps its replica unless it is overloaded, "
                            "else least outstanding requests (default: affinity)")
    serve.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from draftwise.server.serving import serve

    check_server_arguments(args)
    if args.replicas is not None:
        serve_replicated(args)
        return
    app, engine = build_server(args)
    serve(app, engine, args.host, args.port, args.drain_timeout)


def check_server_arguments(args: argparse.Namespace) -> None:
    if args.chat_template is not None:
        from draftwise.text.chat_template import read_chat_template

        read_chat_template(args.chat_template)  # (a missing file said before any model loads)
    if args.max_request_bytes < 1024 or args.drain_timeout < 0:
        raise InvalidParameterError("--max-request-bytes must be at least 1024 and --drain-timeout >= 0")
    if args.replicas is not None and (args.replicas < 1 or args.threads_per_replica < 1):
        raise InvalidParameterError("--replicas and --threads-per-replica must be at least 1")
    if args.replicas is None and (args.address or args.routing != "affinity" or args.threads_per_replica != 1):
        raise InvalidParameterError("--address, --routing and --threads-per-replica need --replicas")
    if args.replicas is not None and args.allowed_origins:
        raise InvalidParameterError("--allowed-origins (CORS) is not supported with --replicas yet: the ingress "
                                    "answers no preflight requests")


def build_server(args: argparse.Namespace, announce: bool = True, replica: bool = False):
    """The engine and its FastAPI app, as `draftwise serve` runs them (one per replica on Ray Serve:
    `replica`, which checks no API key, whatever its environment says: the ingress checks them)."""
    from draftwise.llm import LLM
    from draftwise.server.app import ServerOptions, build_app
    from draftwise.server.async_engine import AsyncEngine
    from draftwise.server.requests import ServerLimits
    from draftwise.server.security import default_allowed_hosts
    from draftwise.speculative.registry import all_specs

    if args.kv_cache_memory_gb is not None and not args.kv_cache_memory_gb > 0:  # (0 is no budget, not the default)
        raise InvalidParameterError(f"--kv-cache-memory-gb must be positive, got {args.kv_cache_memory_gb}")
    kv_bytes = int(args.kv_cache_memory_gb * 2**30) if args.kv_cache_memory_gb is not None else None
    methods = ([spec.name for spec in all_specs() if spec.per_request] if args.per_request_methods is None
               else [m for m in args.per_request_methods.split(",") if m])
    unknown = [m for m in methods if m not in {spec.name for spec in all_specs()}]
    if unknown:
        raise InvalidParameterError(f"--per-request-methods: unknown method(s) {unknown}; known: "
                                    f"{[spec.name for spec in all_specs()]}")
    llm = LLM(args.model, **model_keywords(args),
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, kv_cache_memory_bytes=kv_bytes,
              speculative=speculative_from_args(args, methods), seed=args.seed)
    if args.chat_template is not None:
        from draftwise.text.chat_template import read_chat_template

        llm.tokenizer.use_chat_template(read_chat_template(args.chat_template))
    given = given_options(args)  # (the drafter options given apply to the per-request drafters taking them)
    for method in methods:  # built (and their costs measured) now: no request waits for a build
        try:
            llm.prepare_drafter(method, options_for(method, given, strict=False))
        except InvalidParameterError as error:
            if args.per_request_methods is not None:
                raise  # asked for by name: it must be there
            print(f"per-request drafter {method!r} not offered: {error}", file=sys.stderr, flush=True)
    hosts = (frozenset(h.strip() for h in args.allowed_hosts.split(",") if h.strip()) if args.allowed_hosts
             else default_allowed_hosts(args.host))
    origins = tuple(o.strip() for o in (args.allowed_origins or "").split(",") if o.strip())
    options = ServerOptions(None if replica else _api_keys(args), hosts, origins,
                            ServerLimits(max_request_bytes=args.max_request_bytes), args.drain_timeout)
    engine = AsyncEngine(llm)
    app = build_app(engine, args.served_model_name or args.model, options)
    if announce:
        print(f"serving {args.model} on http://{args.host}:{args.port}/v1"
              + (f" (speculation: {llm.default_method})" if llm.default_method else "")
              + (f"; per-request drafters: {', '.join(sorted(llm.engine.drafters))}" if llm.engine.drafters else ""),
              file=sys.stderr, flush=True)
    return app, engine


def parse_serve_argv(argv: list[str]) -> argparse.Namespace:
    """`draftwise serve` arguments from a list (how each Ray Serve replica rebuilds the server)."""
    parser = argparse.ArgumentParser(prog="draftwise")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def server_from_argv(argv: list[str]):
    """(app, engine) from `draftwise serve` arguments: what each replica runs."""
    return build_server(parse_serve_argv(argv), announce=False, replica=True)


def serve_replicated(args: argparse.Namespace) -> None:
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        raise InvalidParameterError("--replicas runs on Ray Serve, which is not installed: "
                                    "pip install 'draftwise[scaleout]' (or 'ray[serve]')") from None
    from draftwise.scaleout.application import ReplicatedServer
    from draftwise.scaleout.launch import replica_argv, serve_replicas
    from draftwise.server.security import default_allowed_hosts

    from draftwise.loading.resolve import resolve_model

    argv = list(getattr(args, "argv", []) or [])
    argv = argv[argv.index("serve") + 1:] if "serve" in argv else argv
    resolve_model(args.model, load_format=args.load_format)  # (a bad --model said here, not in a replica's log)
    hosts = (tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip()) if args.allowed_hosts
             else tuple(default_allowed_hosts(args.host)))
    config = ReplicatedServer(tuple(replica_argv(argv)), args.replicas, args.threads_per_replica, args.routing,
                              _api_keys(args), hosts, args.drain_timeout,
                              max_request_bytes=args.max_request_bytes)
    serve_replicas(config, server_from_argv, host=args.host, port=args.port, address=args.address,
                   description=args.model)


def replicated_app(args: dict):
    """The Ray Serve application builder for a Serve config file (`import_path:
    draftwise.cli.serve:replicated_app`; its `args` in `draftwise.scaleout.application`)."""
    from draftwise.scaleout.application import build

    return build(args, server_from_argv)


def _api_keys(args: argparse.Namespace) -> tuple[str, ...] | None:
    """--api-key (each one given), else the environment's key, else none."""
    keys = tuple(args.api_key or ()) or ((os.environ[API_KEY_ENV],) if os.environ.get(API_KEY_ENV) else ())
    return keys or None
