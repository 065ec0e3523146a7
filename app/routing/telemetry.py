"""RoutingTelemetry: what the ingress's router decided and what each replica reported, kept for /metrics and spans.

Serve builds the router itself, from a class and keyword arguments, in the process that holds the handle (the
ingress replica), and calls it on its own event-loop thread. So the router reaches the ingress through one
object per process, `TELEMETRY`, named by import path in request_router_kwargs (`LISTENER`): the router calls
its RoutingListener methods, the ingress reads counts for /metrics (app/observability/routing.py) and takes
each request's decision for its span. Every method takes the lock.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from app.routing.router import RoutingDecision

MAX_UNCLAIMED = 10_000  # decisions kept for their request's span; a request that never asks ages out


@dataclass
class ReplicaRouting:
    """One replica's routing counts since this ingress started, and its last report."""

    decisions: Counter[str] = field(default_factory=Counter)  # reason -> requests
    prompt_blocks: int = 0  # full prompt blocks of the requests it was sent
    matched_blocks: int = 0  # of those, blocks the router expected its prefix cache to hold
    reported: dict[str, float] = field(default_factory=dict)  # its last routing stats (app/routing/stats.py)


class RoutingTelemetry:
    """A RoutingListener that keeps per-replica counts and each request's decision until its span takes it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._replicas: dict[str, ReplicaRouting] = {}  # live replicas only: one that left takes its series
        self._unclaimed: OrderedDict[str, RoutingDecision] = OrderedDict()
        self._prefix_blocks: dict[str, int] = {}  # the router's index, as it last told

    def on_decision(self, decision: RoutingDecision) -> None:
        with self._lock:
            replica = self._replica(decision.replica)
            replica.decisions[decision.reason] += 1
            replica.prompt_blocks += decision.prompt_blocks
            replica.matched_blocks += decision.matched_blocks
            self._unclaimed[decision.request_id] = decision
            while len(self._unclaimed) > MAX_UNCLAIMED:
                self._unclaimed.popitem(last=False)

    def on_replica_stats(self, stats: Mapping[str, Mapping[str, float]]) -> None:
        with self._lock:
            for name in [name for name in self._replicas if name not in stats]:
                del self._replicas[name]
            for name, reported in stats.items():
                self._replica(name).reported = dict(reported)

    def on_prefix_index(self, blocks: Mapping[str, int]) -> None:
        with self._lock:
            self._prefix_blocks = dict(blocks)

    def prefix_blocks(self) -> dict[str, int]:
        """Per replica, the prompt blocks the router remembers sending there (as of its last refresh)."""
        with self._lock:
            return dict(self._prefix_blocks)

    def claim(self, request_id: str) -> RoutingDecision | None:
        """The decision for the ingress's request `request_id` (once), or None if the router made none."""
        with self._lock:
            return self._unclaimed.pop(request_id, None)

    def snapshot(self) -> dict[str, ReplicaRouting]:
        """A copy of every live replica's counts and report."""
        with self._lock:
            return {name: ReplicaRouting(Counter(r.decisions), r.prompt_blocks, r.matched_blocks, dict(r.reported))
                    for name, r in self._replicas.items()}

    def _replica(self, name: str) -> ReplicaRouting:
        replica = self._replicas.get(name)
        if replica is None:
            replica = self._replicas[name] = ReplicaRouting()
        return replica


TELEMETRY = RoutingTelemetry()
LISTENER = f"{__name__}:TELEMETRY"
