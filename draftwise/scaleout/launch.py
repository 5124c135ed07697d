"""`draftwise serve --replicas N`: a local Ray cluster (or --address's), the application on it, the
endpoint at --host:--port, and a drain on SIGTERM / Ctrl-C: the ingress refuses new requests (503)
and running ones get up to --drain-timeout seconds, then the application and Ray shut down.

Send SIGTERM to the draftwise process itself (as Kubernetes does): a signal to the whole process
group reaches the local Ray cluster's own processes too, which then stop at once."""

from __future__ import annotations

import shlex
import signal
import sys
import threading

from draftwise.errors import DraftwiseError
from draftwise.scaleout.application import ReplicatedServer, application

# `draftwise serve` flags the ingress or Ray take; the rest configure each replica's engine
_INGRESS_FLAGS = ("--replicas", "--threads-per-replica", "--address", "--routing", "--host", "--port", "--api-key",
                  "--allowed-hosts")
READY_LINE = "replicated server ready"
APP_NAME = "draftwise"


def replica_argv(serve_argv: list[str]) -> list[str]:
    """`draftwise serve`'s arguments without the ones the ingress or Ray take."""
    kept, skip = [], False
    for arg in serve_argv:
        if skip:
            skip = False
        elif arg in _INGRESS_FLAGS:
            skip = True
        elif not arg.startswith(tuple(flag + "=" for flag in _INGRESS_FLAGS)):
            kept.append(arg)
    return kept


def serve_replicas(config: ReplicatedServer, make_server, *, host: str, port: int, address: str | None,
                   description: str) -> None:
    """Run the application until SIGTERM / Ctrl-C, then drain it (see above)."""
    import ray
    from ray import serve

    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(num_cpus=config.replicas * config.threads_per_replica, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    try:
        ingress = serve.run(application(config, make_server), name=APP_NAME, route_prefix="/")
    except RuntimeError as error:  # (a replica that cannot build its server: Ray says only that it failed)
        ray.shutdown()
        raise DraftwiseError(f"the replicas did not start: {str(error).splitlines()[0]} (each replica builds the "
                             f"server `draftwise serve {shlex.join(config.serve_args)}` builds: run that alone to "
                             "see why; Ray's logs are in /tmp/ray/session_latest/logs)") from None
    print(f"{READY_LINE}: {config.replicas} replica(s) x {config.threads_per_replica} thread(s) of {description} "
          f"on http://{host}:{port}/v1 (routing: {config.routing})", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print(f"draining: new requests get 503; running ones have {config.drain_timeout:g} s to finish",
          file=sys.stderr, flush=True)
    left = ingress.drain.remote(config.drain_timeout).result(timeout_s=config.drain_timeout + 30)
    if left:
        print(f"{left} request(s) still running at the deadline: ended", file=sys.stderr, flush=True)
    if address:  # (someone else's cluster: take only this application off it)
        serve.delete(APP_NAME)
    ray.shutdown()  # (a local cluster goes with it, replicas and all)
