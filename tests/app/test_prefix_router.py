"""PrefixAwareRouter (app/routing/router.py) driven as Serve drives it, without Ray: the real RequestRouter
base, PendingRequest and Serve's own routing loop, with stand-ins for RunningReplica (the real one needs a
live actor handle)."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from app.routing.block_hashes import prompt_block_hashes
from app.routing.config import RoutingConfig
from app.routing.request import RoutedRequest
from app.routing.router import PrefixAwareRouter, RoutingDecision, request_router_config
from app.routing.stats import KV_CACHE_USAGE, QUEUE_DEPTH, replica_load

DEPLOYMENT = DeploymentID(name="engine", app_name="test")
BLOCK = 4
SYSTEM = list(range(100, 116))  # four blocks
OTHER_SYSTEM = list(range(500, 516))
_request_ids = itertools.count()


class StubReplica:
    """What a router reads of a RunningReplica: its id, reported stats, capacity, and Serve's queue probe."""

    def __init__(self, name: str, queue_depth: float | None = 0, max_ongoing_requests: int = 8):
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.max_ongoing_requests = max_ongoing_requests
        self.is_cross_language = False
        self.ongoing_requests = 0  # what Serve's probe (get_queue_len) answers
        self.routing_stats: dict = {}
        if queue_depth is not None:
            self.report(queue_depth)

    def report(self, queue_depth: float, kv_cache_usage: float = 0.0) -> None:
        self.routing_stats = {QUEUE_DEPTH: queue_depth, KV_CACHE_USAGE: kv_cache_usage}

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.ongoing_requests


class DecisionLog:
    """A RoutingListener that keeps what it hears."""

    def __init__(self):
        self.decisions: list[RoutingDecision] = []
        self.stats: list[dict] = []
        self.prefix_blocks: list[dict] = []

    def on_decision(self, decision: RoutingDecision) -> None:
        self.decisions.append(decision)

    def on_replica_stats(self, stats) -> None:
        self.stats.append({name: dict(reported) for name, reported in stats.items()})

    def on_prefix_index(self, blocks) -> None:
        self.prefix_blocks.append(dict(blocks))


class BrokenListener:
    def on_decision(self, decision):
        raise RuntimeError("a broken metrics hook")

    def on_replica_stats(self, stats):
        raise RuntimeError("a broken metrics hook")

    def on_prefix_index(self, blocks):
        raise RuntimeError("a broken metrics hook")


MODULE_LISTENER = DecisionLog()  # named by import path, as the ingress names its telemetry


def make_router(replicas: list[StubReplica], **settings) -> PrefixAwareRouter:
    router = PrefixAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN,
                               use_replica_queue_len_cache=True)
    router.initialize_state(routing=RoutingConfig(block_size=BLOCK, **settings).model_dump())
    router.update_replicas(replicas)
    return router


def pending(prompt: list[int] | None) -> PendingRequest:
    i = next(_request_ids)
    args = [RoutedRequest(prompt_block_hashes(prompt, BLOCK))] if prompt is not None else ["a plain argument"]
    metadata = RequestMetadata(request_id=f"req-{i}", internal_request_id=f"int-{i}")
    return PendingRequest(args=args, kwargs={}, metadata=metadata)


async def route(router: PrefixAwareRouter, prompt: list[int] | None) -> str:
    """One routing decision, accepted by the first-ranked replica, as Serve's Router reports it."""
    request = pending(prompt)
    ranks = await router.choose_replicas(router._replicas_list, request)
    chosen = ranks[0][0].replica_id
    router.on_request_routed(request, chosen, result=None)
    return chosen.unique_id


def reasons(router: PrefixAwareRouter) -> dict[tuple[str, str], int]:
    return dict(router.decision_counts)


async def test_requests_sharing_a_prefix_go_to_the_replica_that_was_sent_it():
    router = make_router([StubReplica("a"), StubReplica("b"), StubReplica("c")])
    first = await route(router, SYSTEM + [1, 2, 3, 4])
    assert [await route(router, SYSTEM + [i] * 4) for i in range(5)] == [first] * 5
    assert reasons(router) == {(first, "least_loaded"): 1, (first, "prefix_hit"): 5}


async def test_a_new_prefix_goes_to_the_least_loaded_replica():
    a, b, c = StubReplica("a", 5), StubReplica("b", 1), StubReplica("c", 3)
    router = make_router([a, b, c])
    assert await route(router, SYSTEM) == "b"
    b.report(9)
    assert await route(router, OTHER_SYSTEM) == "c"  # b has SYSTEM, but this prompt shares nothing with it
    assert reasons(router) == {("b", "least_loaded"): 1, ("c", "least_loaded"): 1}


async def test_among_equally_loaded_replicas_a_new_prefix_goes_where_fewest_prefixes_are_held():
    router = make_router([StubReplica("a"), StubReplica("b")])
    assert {await route(router, SYSTEM), await route(router, OTHER_SYSTEM)} == {"a", "b"}


async def test_a_match_on_an_overloaded_replica_falls_back_to_the_least_loaded():
    a, b = StubReplica("a", 0), StubReplica("b", 0)
    router = make_router([a, b], max_imbalance=4)
    home = await route(router, SYSTEM)
    other = b if home == "a" else a
    (a if home == "a" else b).report(6)
    other.report(2)
    assert await route(router, SYSTEM + [1, 1, 1, 1]) == home  # 6 <= 2 + 4: still worth the cache hit
    other.report(1)
    assert await route(router, SYSTEM + [2, 2, 2, 2]) == other.replica_id.unique_id  # 6 > 1 + 4
    assert router.decision_counts[(other.replica_id.unique_id, "imbalance")] == 1


async def test_a_busier_prefix_replica_keeps_its_requests_until_both_imbalance_bounds_are_passed():
    a, b = StubReplica("a", 0), StubReplica("b", 0)
    router = make_router([a, b], max_imbalance=4, max_imbalance_ratio=1.5)
    home = await route(router, SYSTEM)
    home_replica, other = (a, b) if home == "a" else (b, a)
    home_replica.report(40)
    other.report(30)
    assert await route(router, SYSTEM + [1, 1, 1, 1]) == home  # 10 more, but not 1.5 times as many
    other.report(26)
    assert await route(router, SYSTEM + [2, 2, 2, 2]) == other.replica_id.unique_id  # 14 more and 1.54 times


async def test_the_longest_match_wins_and_a_short_match_below_the_minimum_is_ignored():
    a, b, c = StubReplica("a", 0), StubReplica("b", 0), StubReplica("c", 0)
    router = make_router([a, b, c], min_match_blocks=2)
    router.index.insert(a.replica_id, prompt_block_hashes(SYSTEM[:8], BLOCK), now=router._get_curr_time_s())
    router.index.insert(b.replica_id, prompt_block_hashes(SYSTEM, BLOCK), now=router._get_curr_time_s())
    assert await route(router, SYSTEM + [7] * 4) == "b"  # 4 blocks beat a's 2, though a holds fewer
    # only one block in common with a (and b): below min_match_blocks, so the least-loaded replica
    b.report(1)
    a.report(1)
    assert await route(router, SYSTEM[:4] + [8] * 12) == "c"


async def test_load_mode_never_follows_a_prefix():
    a, b = StubReplica("a", 0), StubReplica("b", 0)
    router = make_router([a, b], mode="load")
    home = await route(router, SYSTEM)
    (a if home == "a" else b).report(1)
    assert await route(router, SYSTEM) != home
    assert len(router.index) == 0
    assert {reason for _, reason in router.decision_counts} == {"least_loaded"}


async def test_without_engine_stats_load_is_serves_own_ongoing_request_count():
    a, b = StubReplica("a", None), StubReplica("b", None)
    a.ongoing_requests, b.ongoing_requests = 3, 1
    router = make_router([a, b])
    await asyncio.sleep(0.05)  # update_replicas probes new replicas' queue lengths in the background
    assert await route(router, SYSTEM) == "b"
    assert reasons(router) == {("b", "no_stats"): 1}


def test_stale_engine_stats_are_topped_up_by_this_routers_ongoing_requests():
    assert replica_load({QUEUE_DEPTH: 2.0, KV_CACHE_USAGE: 0.5}, ongoing_requests=5).queue_depth == 5
    assert replica_load({QUEUE_DEPTH: 7.0}, ongoing_requests=5).queue_depth == 7
    assert not replica_load({}, ongoing_requests=None).reported


async def test_a_request_without_a_routed_request_argument_is_routed_by_load():
    router = make_router([StubReplica("a", 2), StubReplica("b", 0)])
    assert await route(router, None) == "b"
    assert len(router.index) == 0


async def test_a_replica_that_leaves_takes_its_prefixes_with_it_and_they_are_rehomed():
    replicas = {name: StubReplica(name) for name in "abc"}
    router = make_router(list(replicas.values()))
    home = await route(router, SYSTEM)
    survivors = [r for name, r in replicas.items() if name != home]
    router.update_replicas(survivors)
    assert router.index.replicas() <= {r.replica_id for r in survivors}
    assert all(name != home for name, _ in router.decision_counts)
    new_home = await route(router, SYSTEM + [1] * 4)
    assert new_home != home
    assert await route(router, SYSTEM + [2] * 4) == new_home
    router.on_replica_actor_died(ReplicaID(unique_id=new_home, deployment_id=DEPLOYMENT))
    assert router.index.replicas() == set()


async def test_listeners_hear_which_replicas_hold_prefixes_and_a_lost_replica_is_forgotten_at_once():
    a, b = StubReplica("a"), StubReplica("b")
    router = make_router([a, b])
    seen = DecisionLog()
    router.add_listener(seen)
    assert seen.prefix_blocks == [{}]
    home = await route(router, SYSTEM)
    other = await route(router, OTHER_SYSTEM)
    assert home != other
    router.update_replicas([a, b])  # Serve's refresh of the replicas' stats
    assert seen.prefix_blocks[-1] == {home: 4, other: 4} == router.prefix_blocks()
    router.update_replicas([r for r in (a, b) if r.replica_id.unique_id != home])  # its node went
    assert seen.prefix_blocks[-1] == {other: 4}
    assert await route(router, SYSTEM) == other  # the lost replica's prefix now routes by load
    router.on_replica_actor_died(ReplicaID(unique_id=other, deployment_id=DEPLOYMENT))
    assert seen.prefix_blocks[-1] == {} == router.prefix_blocks()


async def test_listeners_hear_each_live_replicas_report_and_a_routed_request_carries_the_ingress_id():
    a, b = StubReplica("a", 2), StubReplica("b", 0)
    router = make_router([a, b])
    seen = DecisionLog()
    router.add_listener(seen)
    a.report(3, kv_cache_usage=0.5)
    router.update_replicas([a, b])  # Serve's refresh of the replicas' stats
    assert seen.stats[-1] == {"a": {QUEUE_DEPTH: 3, KV_CACHE_USAGE: 0.5}, "b": {QUEUE_DEPTH: 0, KV_CACHE_USAGE: 0.0}}
    router.update_replicas([b])
    assert seen.stats[-1] == {"b": {QUEUE_DEPTH: 0, KV_CACHE_USAGE: 0.0}}
    request = PendingRequest(args=[RoutedRequest(prompt_block_hashes(SYSTEM, BLOCK), request_id="ingress-7")],
                             kwargs={}, metadata=RequestMetadata(request_id="serve-id", internal_request_id="int-x"))
    [[chosen]] = await router.choose_replicas(router._replicas_list, request)
    router.on_request_routed(request, chosen.replica_id, result=None)
    assert [(d.request_id, d.replica, d.prompt_blocks) for d in seen.decisions] == [("ingress-7", "b", 4)]


async def test_a_request_sent_again_avoids_the_replicas_that_lost_it_while_another_can_take_it():
    a, b, c = StubReplica("a", 0), StubReplica("b", 3), StubReplica("c", 5)
    router = make_router([a, b, c])
    assert await route(router, SYSTEM) == "a"
    hashes = prompt_block_hashes(SYSTEM, BLOCK)
    again = PendingRequest(args=[RoutedRequest(hashes, avoid=("a",))], kwargs={},
                           metadata=RequestMetadata(request_id="r", internal_request_id="again"))
    ranks = await router.choose_replicas(router._replicas_list, again)
    assert [r.replica_id.unique_id for [r] in ranks] == ["b", "c", "a"]  # a is still there, last
    only_a = make_router([StubReplica("a", 0)])
    alone = PendingRequest(args=[RoutedRequest(hashes, avoid=("a",))], kwargs={},
                           metadata=RequestMetadata(request_id="r2", internal_request_id="alone"))
    [[chosen]] = await only_a.choose_replicas(only_a._replicas_list, alone)
    assert chosen.replica_id.unique_id == "a"  # nothing else to take it


async def test_when_every_replica_is_busy_the_router_still_ranks_them_all():
    replicas = [StubReplica(name, 50, max_ongoing_requests=1) for name in "abc"]
    router = make_router(replicas)
    await route(router, SYSTEM)
    request = pending(SYSTEM)
    ranks = await router.choose_replicas(router._replicas_list, request)
    assert sorted(r.replica_id.unique_id for [r] in ranks) == ["a", "b", "c"]
    assert request.routing_context.should_backoff  # Serve sleeps between passes instead of spinning


async def test_a_busy_prefix_replica_makes_the_request_wait_in_serves_queue_not_fail():
    """Serve's own loop: with every replica full the request waits; freed, it goes to the prefix's replica."""
    replicas = {name: StubReplica(name, max_ongoing_requests=1) for name in "ab"}
    router = make_router(list(replicas.values()))
    home = await route(router, SYSTEM)
    for replica in replicas.values():
        replica.ongoing_requests = 1
    router.replica_queue_len_cache.update(replicas["a"].replica_id, 1)
    router.replica_queue_len_cache.update(replicas["b"].replica_id, 1)
    waiting = asyncio.ensure_future(router._choose_replica_for_request(pending(SYSTEM + [3] * 4)))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    for replica in replicas.values():
        replica.ongoing_requests = 0
    chosen = await asyncio.wait_for(waiting, timeout=5)
    assert chosen.replica_id.unique_id == home


async def test_a_replica_other_than_the_preferred_one_taking_the_request_is_reported_as_preferred_busy():
    seen = DecisionLog()
    a, b = StubReplica("a"), StubReplica("b")
    router = make_router([a, b])
    router.add_listener(seen)
    router.add_listener(BrokenListener())  # a broken listener does not break routing
    home = await route(router, SYSTEM)
    request = pending(SYSTEM + [5] * 4)
    [[preferred], [fallback]] = await router.choose_replicas(router._replicas_list, request)
    assert preferred.replica_id.unique_id == home
    router.on_request_routed(request, fallback.replica_id, result=None)
    assert [(d.replica, d.reason) for d in seen.decisions] == [
        (home, "least_loaded"), (fallback.replica_id.unique_id, "preferred_busy")]
    assert seen.decisions[0].request_id.startswith("req-")
    assert seen.decisions[0].prompt_blocks == len(SYSTEM) // BLOCK
    # the replica that took it now has the prefix too
    assert router.index.match_lengths(prompt_block_hashes(SYSTEM, BLOCK), router._get_curr_time_s()) == {
        preferred.replica_id: 4, fallback.replica_id: 4}


def test_serve_options_name_this_router_with_its_settings_or_nothing_for_serve_default():
    assert request_router_config(RoutingConfig(mode="serve-default")) is None
    routing = RoutingConfig(max_imbalance=2, stats_period_s=0.5)
    options = request_router_config(routing, listener=f"{__name__}:MODULE_LISTENER")
    assert options.get_request_router_class() is PrefixAwareRouter
    assert options.request_routing_stats_period_s == 0.5
    router = PrefixAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**options.request_router_kwargs)
    assert router.config.max_imbalance == 2 and router._listeners == [MODULE_LISTENER]
    with pytest.raises(ValueError, match="serve-default"):
        router.initialize_state(routing={"mode": "serve-default"})
