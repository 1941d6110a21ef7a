"""One Prometheus exposition from several servers' /metrics texts, each sample labelled with
the server it came from (the Ray backend's merged /metrics; no Ray needed here).

    body = merge_metrics({"replica-a": text_a, "replica-b": text_b})   # bytes, text format
    # dspark_generation_tokens_total{replica="replica-a"} 12.0 ...

Families of the same name are merged into one (one HELP/TYPE header, all replicas' samples),
so the result is a valid exposition that Prometheus scrapes like a single server's; sum by
name in PromQL for cluster totals, or keep the `replica` label for per-replica views.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Families:
    """A collector that yields fixed, already built metric families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_metrics(texts: Mapping[str, str], label: str = "replica") -> bytes:
    """texts: source name -> Prometheus text; -> one text with `label="<source>"` on every sample."""
    merged: dict[str, Metric] = {}
    for source in sorted(texts):
        for family in text_string_to_metric_families(texts[source]):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            into.samples += [s._replace(labels={**s.labels, label: source}) for s in family.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
