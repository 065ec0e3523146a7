"""PrefixAwareRouter plugged into a real Ray Serve deployment through request_router_config, on the
session's loopback cluster (tests/conftest.py): two replicas of a stub that answers with its replica id."""

from __future__ import annotations

import asyncio
import time

import pytest

from app.routing.block_hashes import prompt_block_hashes
from app.routing.config import RoutingConfig
from app.routing.request import RoutedRequest
from app.routing.router import RoutingDecision, request_router_config
from app.routing.stats import KV_CACHE_USAGE, QUEUE_DEPTH

BLOCK = 4
SYSTEM = list(range(100, 132))
OTHER_SYSTEM = list(range(700, 732))
# the router runs in this process (the handle's), on Serve's router thread
DECISIONS: list[RoutingDecision] = []


class DecisionRecorder:
    """The router's listener, named by import path in request_router_kwargs."""

    def on_decision(self, decision: RoutingDecision) -> None:
        DECISIONS.append(decision)

    def on_replica_stats(self, stats) -> None:
        pass

    def on_prefix_index(self, blocks) -> None:
        pass


RECORDER = DecisionRecorder()


@pytest.mark.timeout(240)
async def test_a_shared_prefix_sticks_to_one_replica_and_a_new_prefix_takes_the_other(serve_cluster):
    from ray import serve

    routing = RoutingConfig(block_size=BLOCK, stats_period_s=0.2)

    @serve.deployment(num_replicas=2, max_ongoing_requests=8, ray_actor_options={"num_cpus": 0},
                      request_router_config=request_router_config(routing, f"{__name__}:RECORDER"))
    class WhoAmI:
        async def __call__(self, routed: RoutedRequest) -> str:
            assert isinstance(routed, RoutedRequest)  # the replica receives what the router read
            return serve.get_replica_context().replica_id.unique_id

        def record_routing_stats(self) -> dict[str, float]:
            return {QUEUE_DEPTH: 0.0, KV_CACHE_USAGE: 0.0}

    handle = serve.run(WhoAmI.bind(), name="prefix-routing", route_prefix=None)
    try:
        async def send(prompt: list[int]) -> str:
            return await handle.remote(RoutedRequest(prompt_block_hashes(prompt, BLOCK)))

        # record_routing_stats reaches the router within a few periods: a plain request is then least_loaded
        deadline = time.monotonic() + 30
        while not DECISIONS or DECISIONS[-1].reason == "no_stats":
            assert time.monotonic() < deadline, f"no routing stats in 30 s: {DECISIONS[-3:]}"
            await send([])
            await asyncio.sleep(0.2)
        DECISIONS.clear()

        shared = [await send(SYSTEM + [i] * BLOCK) for i in range(8)]
        assert len(set(shared)) == 1, shared
        # equal load, and the first replica already holds a prefix: a new prefix goes to the other one
        other = [await send(OTHER_SYSTEM + [i] * BLOCK) for i in range(4)]
        assert len(set(other)) == 1 and other[0] != shared[0], (shared, other)
        assert await send(SYSTEM + [99] * BLOCK) == shared[0]
        assert [d.reason for d in DECISIONS] == ["least_loaded"] + ["prefix_hit"] * 7 + ["least_loaded"] + [
            "prefix_hit"] * 4
        assert DECISIONS[-1].matched_blocks == len(SYSTEM) // BLOCK
    finally:
        serve.delete("prefix-routing")
