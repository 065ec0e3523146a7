"""Prometheus metrics of the ingress's routing across engine replicas, read at scrape time from RoutingTelemetry.

Per replica (label `replica`, Serve's unique id, as on the replicas' own series): requests routed there by
reason, the prompt blocks sent there and those the router expected its prefix cache to hold (the router's
hit rate), and the replica's own prefix-cache counters as it last reported them to the router (its measured
hit rate, within one routing-stats period), and the prompt blocks the router's prefix index holds for it (what
it would route by prefix; as of Serve's last refresh of the replicas). A replica that leaves takes its series
with it. Requests that the
ingress sent again after their replica was lost are counted in `routing_retries`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from app.observability.metrics import PREFIX
from app.routing.stats import KV_CACHE_USAGE, PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES, QUEUE_DEPTH
from app.routing.telemetry import RoutingTelemetry

LABELS = ("model_name", "replica")
COUNTERS = ("routing_decisions", "routing_prompt_blocks", "routing_matched_blocks", "routing_retries",
            "replica_prefix_cache_queries", "replica_prefix_cache_hits")
# the load the router compares, as each replica last reported it (app/routing/stats.py)
GAUGES = ("routing_prefix_blocks", "replica_reported_queue_depth", "replica_reported_kv_cache_usage")


def routing_series_names() -> set[str]:
    """The sample names the ingress's /metrics can show (the Grafana dashboard's test checks against them)."""
    return {f"{PREFIX}{name}_total" for name in COUNTERS} | {PREFIX + name for name in GAUGES}


class RoutingCollector(Collector):
    """The per-replica routing series, from a snapshot of the telemetry at each scrape."""

    def __init__(self, telemetry: RoutingTelemetry, model_name: str):
        self.telemetry = telemetry
        self.model_name = model_name

    def describe(self):
        return []

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        replicas = self.telemetry.snapshot()
        decisions = CounterMetricFamily(PREFIX + "routing_decisions", "Requests routed to a replica, by reason.",
                                        labels=(*LABELS, "reason"))
        prompt_blocks = self._family("routing_prompt_blocks", "Full KV blocks of the prompts routed to a replica.")
        matched = self._family("routing_matched_blocks",
                               "Of those, blocks the router expected the replica's prefix cache to hold.")
        queries = self._family("replica_prefix_cache_queries",
                               "Prompt tokens the replica looked up in its prefix cache (its last report).")
        hits = self._family("replica_prefix_cache_hits",
                            "Prompt tokens the replica found in its prefix cache (its last report).")
        reported_load = {
            key: GaugeMetricFamily(PREFIX + name, doc, labels=LABELS) for key, name, doc in (
                (QUEUE_DEPTH, "replica_reported_queue_depth",
                 "Sequences waiting and running in the replica's engine, as it last reported to the router."),
                (KV_CACHE_USAGE, "replica_reported_kv_cache_usage",
                 "Share of the replica's KV blocks held by live sequences, as it last reported to the router."))}
        for name, replica in sorted(replicas.items()):
            labels = [self.model_name, name]
            for reason, count in sorted(replica.decisions.items()):
                decisions.add_metric([*labels, reason], count)
            prompt_blocks.add_metric(labels, replica.prompt_blocks)
            matched.add_metric(labels, replica.matched_blocks)
            if PREFIX_CACHE_QUERIES in replica.reported:
                queries.add_metric(labels, replica.reported[PREFIX_CACHE_QUERIES])
                hits.add_metric(labels, replica.reported.get(PREFIX_CACHE_HITS, 0.0))
            for key, family in reported_load.items():
                if key in replica.reported:
                    family.add_metric(labels, replica.reported[key])
        index = GaugeMetricFamily(PREFIX + "routing_prefix_blocks",
                                  "Prompt blocks the router remembers sending to a replica (its prefix index).",
                                  labels=LABELS)
        for name, blocks in sorted(self.telemetry.prefix_blocks().items()):
            index.add_metric([self.model_name, name], blocks)
        yield from (decisions, prompt_blocks, matched, queries, hits, index, *reported_load.values())

    def _family(self, name: str, doc: str) -> CounterMetricFamily:
        return CounterMetricFamily(PREFIX + name, doc, labels=LABELS)


class IngressMetrics:
    """The ingress's Prometheus registry: the routing series, and the requests it sent again."""

    def __init__(self, telemetry: RoutingTelemetry, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(RoutingCollector(telemetry, model_name))
        self.retries = Counter(PREFIX + "routing_retries", "Requests sent to another replica after theirs was "
                               "lost before answering.", ("model_name",), registry=self.registry).labels(model_name)
