"""PrefixAwareRouter: Ray Serve request routing by cached prompt prefix, bounded by replica load (issue 17).

Policy. A request carries its prompt's chained block hashes (RoutedRequest, the first positional argument
of the handle call). In mode `prefix` the router asks its PrefixIndex how many leading blocks of the prompt
each replica was sent before. Among replicas with at least `min_match_blocks` matched, longest match first,
it takes the first that is not too busy ("prefix_hit"): too busy is a load over the least load by more than
`max_imbalance` sequences and more than `max_imbalance_ratio` times the least load (both, as SGLang's
cache-aware router: a recomputed prefix costs more than a few extra sequences in a batch). When every
matching replica is too busy, the least-loaded replica gets the request ("imbalance"). Without such
a match, or in mode `load`, the least-loaded replica gets it ("least_loaded"; "no_stats" while no replica
has reported engine stats, so load is only this router's own count of ongoing requests). Load is
stats.replica_load: engine queue depth, then KV-cache usage, then the fewest remembered prefix blocks, so
new prefixes spread. The router returns every candidate, one per rank, best first: Serve tries them in
order, skips full ones and backs off when all are full, so routing never blocks and never fails on load
("preferred_busy" when a later rank took the request). The prompt's blocks are recorded for the chosen
replica at once, so a burst sharing a new prefix follows its first request, and again for the replica that
accepted it. Each routed request makes one RoutingDecision, counted per (replica, reason) and passed to
listeners (RoutingListener: the ingress's telemetry, app/routing/telemetry.py), which also hear every
replica's reported stats, and how many prefix blocks the index holds per replica, each time Serve refreshes
the replica set or their stats. A replica that leaves (Serve's new set lacks it, or its actor died) leaves the
index at once: its prefixes then route by load, wherever the new replicas are. No FIFOMixin: with it a replica chosen for one request's prefix would go to whichever request is
first in the queue; Serve's base matching gives it to the request it was chosen for.
"""

from __future__ import annotations

import importlib
import logging
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from app.routing.config import RoutingConfig
from app.routing.prefix_index import PrefixIndex
from app.routing.request import RoutedRequest
from app.routing.stats import ReplicaLoad, replica_load

logger = logging.getLogger("shardserve.routing")

MAX_PLANS = 10_000  # decisions awaiting their request's acceptance; a cancelled request's plan ages out


@dataclass(frozen=True)
class RoutingDecision:
    """Where one request went and why: what metrics count and a span attribute reports."""

    request_id: str
    replica: str  # Serve's replica unique_id
    reason: str  # prefix_hit, least_loaded, imbalance, no_stats or preferred_busy (the module docstring)
    matched_blocks: int  # prompt blocks the chosen replica was already sent
    queue_depth: float  # the chosen replica's load when the router chose
    prompt_blocks: int = 0  # full KV blocks of the prompt (0: the call carried no prompt)


class RoutingListener(Protocol):
    """What a router tells (a listener is named by "module:attribute" in request_router_kwargs). Both are
    called on the router's event loop thread, so a listener read from another thread takes a lock."""

    def on_decision(self, decision: RoutingDecision) -> None:
        """A replica accepted a request: where it went and why."""

    def on_replica_stats(self, stats: Mapping[str, Mapping[str, float]]) -> None:
        """The live replicas (Serve unique_id) and what each last reported (app/routing/stats.py)."""

    def on_prefix_index(self, blocks: Mapping[str, int]) -> None:
        """The prompt blocks the router remembers sending to each replica (Serve unique_id; none: left out)."""


@dataclass(frozen=True)
class _Plan:
    preferred: ReplicaID
    reason: str
    block_hashes: tuple[bytes, ...]
    matched_blocks: dict[ReplicaID, int]  # replicas with a match only
    queue_depths: dict[ReplicaID, float]
    request_id: str  # the ingress's id when the call carried one, else Serve's


def routed_request(pending_request: PendingRequest | None) -> RoutedRequest | None:
    """The call's RoutedRequest (its first positional argument), if it has one."""
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, RoutedRequest) else None


class PrefixAwareRouter(RequestRouter):
    """Prefix affinity within a load bound; see the module docstring for the policy."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._configure(RoutingConfig(), listener=None)

    def initialize_state(self, routing: dict | None = None, listener: str | None = None) -> None:
        """Serve calls this with `request_router_kwargs`: the RoutingConfig as a dict, and an optional
        "module:attribute" naming a RoutingListener in this process."""
        self._configure(RoutingConfig(**(routing or {})), listener)

    def _configure(self, config: RoutingConfig, listener: str | None) -> None:
        if config.mode == "serve-default":
            raise ValueError(
                "routing mode serve-default means Serve's own router: leave request_router_config unset")
        self.config = config
        self.index: PrefixIndex[ReplicaID] = PrefixIndex(config.ttl_s, config.max_blocks_per_replica)
        self.decision_counts: Counter[tuple[str, str]] = Counter()  # (replica unique_id, reason) -> requests
        self._listeners: list[RoutingListener] = []
        if listener:
            self.add_listener(_import_attribute(listener))
        self._plans: OrderedDict[str, _Plan] = OrderedDict()  # internal request id -> the choice made

    def add_listener(self, listener: RoutingListener) -> None:
        self._listeners.append(listener)
        _tell(listener, "on_replica_stats", self._replica_stats())
        _tell(listener, "on_prefix_index", self.prefix_blocks())

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Every candidate, one per rank, best first (never empty while there are candidates)."""
        if pending_request is not None:
            # Serve retries the ranks without sleeping unless told to back off; back off when all are full.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        now = self._get_curr_time_s()
        loads = {
            r.replica_id: replica_load(r.routing_stats, self._replica_queue_len_cache.get(r.replica_id))
            for r in candidate_replicas
        }
        routed = routed_request(pending_request)
        avoid = set(routed.avoid) if routed is not None else set()
        # replicas that lost this request before go last; one of them still serves if nothing else can
        by_load = sorted(candidate_replicas, key=lambda r: (
            r.replica_id.unique_id in avoid, *self._load_order(r.replica_id, loads[r.replica_id])))
        block_hashes = routed.block_hashes if routed is not None and self.config.mode == "prefix" else ()
        lengths = self.index.match_lengths(block_hashes, now, loads) if block_hashes else {}
        preferred = [r for r in by_load if r.replica_id.unique_id not in avoid] or by_load
        chosen, reason = self._decide(preferred, loads, lengths)
        if block_hashes:
            self.index.insert(chosen.replica_id, block_hashes, now)
        if pending_request is not None:
            queue_depths = {replica_id: load.queue_depth for replica_id, load in loads.items()}
            request_id = (routed.request_id if routed is not None else "") or pending_request.metadata.request_id
            self._remember(pending_request,
                           _Plan(chosen.replica_id, reason, block_hashes, lengths, queue_depths, request_id))
        return [[chosen]] + [[r] for r in by_load if r is not chosen]

    def _load_order(self, replica_id: ReplicaID, load: ReplicaLoad) -> tuple[float, float, int]:
        return load.queue_depth, load.kv_cache_usage, self.index.num_blocks(replica_id)

    def _decide(
        self,
        by_load: list[RunningReplica],
        loads: dict[ReplicaID, ReplicaLoad],
        lengths: dict[ReplicaID, int],
    ) -> tuple[RunningReplica, str]:
        least_loaded = by_load[0]
        matching = [r for r in by_load if lengths.get(r.replica_id, 0) >= self.config.min_match_blocks]
        matching.sort(key=lambda r: -lengths[r.replica_id])  # stable: equal matches stay in load order
        least = loads[least_loaded.replica_id].queue_depth
        for replica in matching:
            if not self._too_busy(loads[replica.replica_id].queue_depth, least):
                return replica, "prefix_hit"
        if matching:
            reason = "imbalance"
        elif any(load.reported for load in loads.values()):
            reason = "least_loaded"
        else:
            reason = "no_stats"
        return least_loaded, reason

    def _too_busy(self, load: float, least: float) -> bool:
        return load - least > self.config.max_imbalance and load > self.config.max_imbalance_ratio * least

    def _remember(self, pending_request: PendingRequest, plan: _Plan) -> None:
        key = pending_request.metadata.internal_request_id
        self._plans.pop(key, None)
        self._plans[key] = plan
        while len(self._plans) > MAX_PLANS:
            self._plans.popitem(last=False)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """A replica accepted the request: record its prefix there and report the decision."""
        plan = self._plans.pop(pending_request.metadata.internal_request_id, None)
        if plan is None:
            return
        if plan.block_hashes:
            self.index.insert(replica_id, plan.block_hashes, self._get_curr_time_s())
        reason = plan.reason if replica_id == plan.preferred else "preferred_busy"
        self.decision_counts[(replica_id.unique_id, reason)] += 1
        decision = RoutingDecision(
            plan.request_id, replica_id.unique_id, reason, plan.matched_blocks.get(replica_id, 0),
            plan.queue_depths.get(replica_id, 0.0), len(plan.block_hashes))
        self._tell_listeners("on_decision", decision)

    def _tell_listeners(self, method: str, argument) -> None:
        for listener in self._listeners:
            _tell(listener, method, argument)

    def _replica_stats(self) -> dict[str, dict[str, float]]:
        return {r.replica_id.unique_id: dict(r.routing_stats) for r in self._replicas_list}

    def prefix_blocks(self) -> dict[str, int]:
        """Per replica (Serve unique_id) the index holds any for: how many prompt blocks it remembers there."""
        return {replica_id.unique_id: self.index.num_blocks(replica_id) for replica_id in self.index.replicas()}

    def _tell_replica_state(self) -> None:
        self._tell_listeners("on_replica_stats", self._replica_stats())
        self._tell_listeners("on_prefix_index", self.prefix_blocks())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new replica set, or fresh stats of the same one; replicas that left leave the index and the
        counts, and listeners hear what every live replica reported and what the index holds."""
        super().update_replicas(replicas)
        for gone in self.index.replicas() - self._replica_id_set:
            self.index.remove_replica(gone)
        self._drop_counts_of_replicas_not_in(self._replica_id_set)
        self._tell_replica_state()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.remove_replica(replica_id)
        self._drop_counts_of_replicas_not_in(self._replica_id_set)
        self._tell_replica_state()

    def _drop_counts_of_replicas_not_in(self, replica_ids: set[ReplicaID]) -> None:
        live = {replica_id.unique_id for replica_id in replica_ids}
        for key in [key for key in self.decision_counts if key[0] not in live]:
            del self.decision_counts[key]


def _tell(listener: RoutingListener, method: str, argument) -> None:
    try:
        getattr(listener, method)(argument)
    except Exception:  # telemetry must never break routing
        logger.exception("routing listener %r failed in %s", listener, method)


def request_router_config(
    config: RoutingConfig, listener: str | None = None
) -> RequestRouterConfig | None:
    """The deployment's `request_router_config` for these settings; None for serve-default (Serve's own).
    `listener`: "module:attribute" of a RoutingListener in the calling process (the ingress's telemetry)."""
    if config.mode == "serve-default":
        return None
    kwargs: dict = {"routing": config.model_dump()}
    if listener:
        kwargs["listener"] = listener
    return RequestRouterConfig(request_router_class=PrefixAwareRouter, request_router_kwargs=kwargs,
                               request_routing_stats_period_s=config.stats_period_s)


def _import_attribute(path: str) -> RoutingListener:
    module_name, _, attr = path.partition(":")
    if not attr:
        module_name, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)
