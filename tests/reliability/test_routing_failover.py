"""A replica killed while prefix routing spreads a load over two (issue 17: "no request is lost when a replica dies
mid-run"): `shardserve serve` as a user runs it, two replicas of the demo model behind the ingress, streamed and
plain chats over four system prompts at concurrency 8, one replica's process SIGKILLed once both hold requests,
repeated. Every request must end: a plain one with 200 (the ingress re-sends it to the survivor), a stream with
[DONE] after all its tokens or, only if it had started on the killed replica, the `replica_lost` error event and
[DONE]. `make stress` runs it and prints how many were re-sent, cut, and lost (always 0).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.reliability.chaos import descendants_titled
from tests.reliability.test_recovery_stress import DEMO_MODEL_NAME, REPLICA_TITLE, shardserve

ROUNDS = 2
REQUESTS, CONCURRENCY, MAX_TOKENS = 32, 8, 120
SYSTEMS = [f"You are assistant number {i}. Answer briefly and politely, in plain words. " * 4 for i in range(4)]


def routed_so_far(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "shardserve:routing_decisions_total")


def reporting_replicas(base: str) -> int:
    """Replicas whose load reports reach the ingress's router (a replaced one counts once it is serving)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(1 for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "shardserve:replica_prefix_cache_queries_total")


def retries(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return next(s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == "shardserve:routing_retries_total")


async def one_request(http: httpx.AsyncClient, index: int) -> str:
    """What the client saw: "ok", "cut" (a started stream ended by replica_lost), or what went wrong."""
    stream = index % 2 == 0
    body = {"model": DEMO_MODEL_NAME, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream,
            "messages": [{"role": "system", "content": SYSTEMS[index % len(SYSTEMS)]},
                         {"role": "user", "content": f"Question {index}: what is {index} plus one?"}]}
    if not stream:
        r = await http.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {r.text[:120]}"
        return "ok" if r.json()["usage"]["completion_tokens"] == MAX_TOKENS else f"short: {r.text[:120]}"
    events = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return f"HTTP {r.status_code}"
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    if events[-1:] != ["[DONE]"]:
        return f"no [DONE]: {events[-2:]}"
    errors = [json.loads(e)["error"]["code"] for e in events[:-1] if '"error"' in e]
    if errors:
        return "cut" if errors == ["replica_lost"] else f"error {errors}"
    finished = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"] if c.get("finish_reason")]
    return "ok" if finished == ["length"] else f"finish {finished}"


async def load_across_a_kill(base: str, server_pid: int) -> tuple[list[str], float]:
    """REQUESTS requests at CONCURRENCY; one replica killed once CONCURRENCY of them are routed."""
    replicas = descendants_titled(server_pid, REPLICA_TITLE)
    assert len(replicas) == 2, replicas
    queue = list(range(REQUESTS))
    outcomes: list[str] = []
    start = routed_so_far(base)

    async with httpx.AsyncClient(base_url=base, timeout=300) as http:
        async def worker():
            while queue:
                outcomes.append(await one_request(http, queue.pop(0)))

        workers = [asyncio.create_task(worker()) for _ in range(CONCURRENCY)]
        deadline = time.monotonic() + 120
        while await asyncio.to_thread(routed_so_far, base) < start + CONCURRENCY:
            assert time.monotonic() < deadline, "the load never reached the replicas"
            await asyncio.sleep(0.1)
        os.kill(replicas[0], signal.SIGKILL)
        killed_at = time.monotonic()
        await asyncio.gather(*workers)
    return outcomes, time.monotonic() - killed_at


@pytest.mark.stress
@pytest.mark.timeout(1800)
def test_no_request_is_lost_when_a_replica_dies_under_prefix_routing(tmp_path, figures, smollm2_gguf):
    flags = ["--num-replicas", "2", "--max-num-seqs", "8", "--routing-stats-period-s", "0.2"]
    with shardserve(tmp_path / "serve.log", *flags) as (server, base):
        for round_index in range(ROUNDS):
            deadline = time.monotonic() + 300  # both replicas serving (the second round: the replacement too)
            while reporting_replicas(base) != 2 or len(descendants_titled(server.pid, REPLICA_TITLE)) != 2:
                assert time.monotonic() < deadline, "two replicas never served together"
                time.sleep(0.5)
            before = retries(base)
            outcomes, drained_s = asyncio.run(load_across_a_kill(base, server.pid))
            lost = [o for o in outcomes if o not in ("ok", "cut")]
            assert len(outcomes) == REQUESTS and not lost, lost
            figures.append(f"round {round_index + 1}: {REQUESTS} requests at concurrency {CONCURRENCY}, one of 2 "
                           f"replicas SIGKILLed: {outcomes.count('ok')} complete, {outcomes.count('cut')} started "
                           f"streams cut (replica_lost), {retries(base) - before:.0f} re-sent to the survivor, "
                           f"0 lost; last answer {drained_s:.1f} s after the kill")
