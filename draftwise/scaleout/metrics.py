"""One Prometheus view of all replicas: each replica's /metrics text parsed (prometheus_client's
parser), a `replica` label added to every sample, families of one name merged, and the ingress's own
routing metrics beside them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Merged:
    """A collector yielding the merged families (what `generate_latest` renders)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return self.families


def merge_replica_metrics(texts: dict[int, str]) -> list[Metric]:
    """Families by name, each sample labelled with the replica whose text it came from."""
    merged: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            target = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            for sample in family.samples:
                target.samples.append(sample._replace(labels={**sample.labels, "replica": str(replica)}))
    return list(merged.values())


class IngressMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.routed = Counter("draftwise:router_requests", "Requests routed, by replica and how it was chosen "
                              "(affinity: the key's replica; spilled: another, for load; least_loaded; random).",
                              ["replica", "outcome"], registry=self.registry)
        self.replica_failures = Counter("draftwise:router_replica_failures", "Requests whose replica failed, by "
                                        "when (before_response: retried on another; mid_stream: ended with an "
                                        "error event).", ["replica", "when"], registry=self.registry)
        self.up = Gauge("draftwise:replica_up", "1 while the replica answers, 0 while it is down.", ["replica"],
                        registry=self.registry)

    def render(self, replica_texts: dict[int, str]) -> bytes:
        registry = CollectorRegistry()
        registry.register(_Merged(merge_replica_metrics(replica_texts)))
        return generate_latest(registry) + generate_latest(self.registry)
