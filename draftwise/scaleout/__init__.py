"""Scale-out on Ray Serve: N engine replicas behind one OpenAI endpoint (`draftwise serve --replicas N`).

- `replica.py`: one deployment per replica, each the whole `draftwise serve` app (engine, validation,
  streaming) called in-process through ASGI (`asgi_call.py`);
- `ingress.py`: the HTTP entry: routes each request (`routing.py`, keys from `affinity.py`), passes
  streams through, ends a stream whose replica dies with an error event, answers /health per replica
  and /metrics for all of them (`metrics.py`, a `replica` label on every sample);
- `application.py`: the Ray Serve application (importable, configurable from YAML);
- `launch.py`: what `draftwise serve --replicas` does (a local Ray cluster or --address, drain on SIGTERM).
"""
