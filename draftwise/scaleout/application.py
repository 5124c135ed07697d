"""The Ray Serve application: N replica deployments and the ingress in front of them.

For an existing cluster's Serve config (`serve run serve.yaml`), through the CLI's builder (it hands
the replicas `draftwise serve`'s way of building a server from its flags):

    applications:
      - name: draftwise
        route_prefix: /
        import_path: draftwise.cli.serve:replicated_app
        args:
          replicas: 2
          threads_per_replica: 1
          routing: affinity            # or least_loaded, random
          serve_args: ["--model", "qwen2.5-coder-0.5b", "--max-num-seqs", "8"]
          max_request_bytes: 8388608   # the ingress answers 413 above it, before reading the rest

`serve_args` are `draftwise serve`'s own flags (the model, speculation, limits): every replica builds
its engine from them. Each replica is a deployment of its own (`draftwise-replica-<i>`, one Ray
actor of `threads_per_replica` CPUs), so that the ingress can route by affinity and load itself;
Ray Serve restarts a replica that dies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray import serve

from draftwise.errors import InvalidParameterError
from draftwise.scaleout.replica import EngineReplica
from draftwise.scaleout.routing import POLICIES
from draftwise.server.requests import DEFAULT_MAX_REQUEST_BYTES
from draftwise.server.security import api_keys

HEALTH_CHECK_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class ReplicatedServer:
    serve_args: tuple[str, ...]
    replicas: int = 2
    threads_per_replica: int = 1
    routing: str = "affinity"
    api_key: str | tuple[str, ...] | None = None  # several: each is accepted (one tenant: see the README)
    allowed_hosts: tuple[str, ...] = ("*",)  # Host names the ingress answers
    drain_timeout: float = 30.0
    max_ongoing_requests: int = 256  # per replica: its engine queues what it cannot batch yet
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # the ingress refuses larger bodies (413)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.extra:
            raise InvalidParameterError(f"unknown scale-out argument(s): {', '.join(sorted(self.extra))} "
                                        "(known: replicas, threads_per_replica, routing, api_key, allowed_hosts, drain_timeout, "
                                        "max_ongoing_requests, max_request_bytes, serve_args)")
        for name in ("serve_args", "allowed_hosts"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or any(not isinstance(item, str) for item in value):
                raise InvalidParameterError(f"{name} must be a list of strings, got {value!r}")
        api_keys(self.api_key)  # (an empty or non-string key refused by name)
        for name in ("replicas", "threads_per_replica", "max_ongoing_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidParameterError(f"{name} must be an integer of at least 1, got {value!r}")
        if isinstance(self.drain_timeout, bool) or not isinstance(self.drain_timeout, (int, float)) \
                or not self.drain_timeout >= 0:
            raise InvalidParameterError(f"drain_timeout must be a number of seconds >= 0, got {self.drain_timeout!r}")
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1024:
            raise InvalidParameterError(f"max_request_bytes must be an integer of at least 1024, got {self.max_request_bytes!r}")
        if self.routing not in POLICIES:
            raise InvalidParameterError(f"routing must be one of {', '.join(POLICIES)}, got {self.routing!r}")


def build(args: dict, make_server):
    """The application from a Serve config's `args` (see above); make_server(argv) -> (app, engine)."""
    known = {"serve_args", "replicas", "threads_per_replica", "routing", "api_key", "allowed_hosts", "drain_timeout",
             "max_ongoing_requests", "max_request_bytes"}
    config = ReplicatedServer(**{k: (tuple(v) if k in ("serve_args", "allowed_hosts") and isinstance(v, list) else v)
                                 for k, v in args.items() if k in known},
                              extra={k: v for k, v in args.items() if k not in known})
    return application(config, make_server)


def application(config: ReplicatedServer, make_server):
    from draftwise.scaleout.ingress import Ingress

    names = tuple(f"draftwise-replica-{index}" for index in range(config.replicas))
    replicas = [
        serve.deployment(EngineReplica, name=names[index], num_replicas=1,
                         ray_actor_options={"num_cpus": config.threads_per_replica},
                         max_ongoing_requests=config.max_ongoing_requests,
                         graceful_shutdown_timeout_s=config.drain_timeout,
                         health_check_period_s=HEALTH_CHECK_SECONDS).bind(
            make_server, [*config.serve_args, "--allowed-hosts", "*"],  # (the ingress checks Host names)
            config.threads_per_replica, index)
        for index in range(config.replicas)]
    return Ingress.options(name="draftwise-ingress").bind(*replicas, replica_names=names, routing=config.routing,
                                                          api_key=config.api_key, allowed_hosts=config.allowed_hosts,
                                                          max_request_bytes=config.max_request_bytes)
