"""The load a replica reports to the routers (Serve routing stats), and the load the router compares.

A replica's deployment defines `record_routing_stats(self) -> dict` returning `engine_routing_stats(...)`;
Serve's controller polls it every `request_routing_stats_period_s` and hands the dict to every router as
`RunningReplica.routing_stats`, so it reflects every router's requests but is up to a period old. The
router's own count of ongoing requests at a replica (Serve's queue-length cache) is fresh but sees only its
own requests. The compared load is the larger of the two, so a burst from this router shows at once and
load from other routers shows within a period.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.outputs import EngineStats

QUEUE_DEPTH = "queue_depth"  # sequences waiting plus running in the replica's engine
KV_CACHE_USAGE = "kv_cache_usage"  # share of the replica's KV blocks in use, 0..1
# the replica's prefix cache since it started: prompt tokens looked up, and those found (its hit rate)
PREFIX_CACHE_QUERIES = "prefix_cache_queries"
PREFIX_CACHE_HITS = "prefix_cache_hits"


def engine_routing_stats(stats: EngineStats) -> dict[str, float]:
    """What a replica's `record_routing_stats` returns: its engine's queue depth and KV-cache usage (what the
    router compares), and its prefix cache's counters (what the ingress reports as the replica's hit rate)."""
    return {
        QUEUE_DEPTH: float(stats.num_waiting + stats.num_running),
        KV_CACHE_USAGE: float(stats.kv_cache_usage),
        PREFIX_CACHE_QUERIES: float(stats.prefix_cache_queries),
        PREFIX_CACHE_HITS: float(stats.prefix_cache_hits),
    }


@dataclass(frozen=True, order=True)
class ReplicaLoad:
    """Ordered as the router prefers replicas: fewer queued sequences, then emptier KV cache."""

    queue_depth: float
    kv_cache_usage: float
    reported: bool  # the replica's engine has reported stats (else queue_depth is the router's own count)


def replica_load(routing_stats: Mapping[str, Any], ongoing_requests: int | None) -> ReplicaLoad:
    """The load the router compares: a replica's routing stats, and this router's ongoing requests there."""
    ongoing = float(ongoing_requests or 0)
    reported = isinstance(routing_stats.get(QUEUE_DEPTH), (int, float))
    if not reported:
        return ReplicaLoad(ongoing, 0.0, reported=False)
    kv_cache_usage = routing_stats.get(KV_CACHE_USAGE, 0.0)
    kv_cache_usage = float(kv_cache_usage) if isinstance(kv_cache_usage, (int, float)) else 0.0
    return ReplicaLoad(max(float(routing_stats[QUEUE_DEPTH]), ongoing), kv_cache_usage, reported=True)
