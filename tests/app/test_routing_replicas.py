"""Two replicas of the tiny Llama behind the ingress and the prefix-aware router, on the session's local Ray Serve,
over real HTTP with the `openai` client: where requests go (read off the ingress's /metrics), that the chosen
replica's prefix cache hits (usage.prompt_tokens_details), that nothing blocks or is lost, and that a killed
replica is forgotten. The tests run in file order and share one application; the last one kills a replica."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams
from tests.app.conftest import API_KEY, SERVED_NAME, tiny_serve_args
from tests.app.test_serve_openai import poll
from tests.reliability.chaos import alive_actors

APP = "routed"
ROUTE = "/routed"
BLOCK = 16
MAX_ONGOING = 3  # per replica: 6 requests fill both
SYSTEM_A = "You are a terse assistant who answers in one word. " * 2  # about 4 blocks
SYSTEM_B = "You are a pirate: every answer ends with arr, and you never break character. " * 4  # about 12
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def routed(serve_cluster, tiny_llama_dir):
    """The tiny Llama, two replicas, prefix routing (the default) with load reports every 0.2 s."""
    from ray import serve

    from app.deployment import build_app

    args = tiny_serve_args(tiny_llama_dir, num_replicas=2, max_num_seqs=4, max_ongoing_requests=MAX_ONGOING,
                           routing_stats_period_s=0.2, block_size=BLOCK)
    serve.run(build_app(args), name=APP, route_prefix=ROUTE)
    yield serve_cluster.url(ROUTE)
    serve.delete(APP)


@pytest.fixture
def client(routed) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{routed}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def routing_counts(url: str) -> Counter:
    """(replica, reason) -> requests routed, from the ingress's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return Counter({(s.labels["replica"], s.labels["reason"]): int(s.value)
                    for family in text_string_to_metric_families(text) for s in family.samples
                    if s.name == "shardserve:routing_decisions_total"})


def metric(url: str, name: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {s.labels.get("replica", ""): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def replica_of(url: str, send):
    """Run `send()` (one request at a time) and return (its result, the replica it went to, and why)."""
    before = routing_counts(url)
    result = send()
    [(replica, reason)] = list((routing_counts(url) - before).elements())
    return result, replica, reason


def chat(client: openai.OpenAI, system: str, question: str, history: list[dict] = (), max_tokens: int = 6):
    messages = [{"role": "system", "content": system}, *history, {"role": "user", "content": question}]
    return client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=max_tokens,
                                          temperature=0)


def wait_for_load_reports(url: str, client: openai.OpenAI) -> None:
    """Until both replicas have reported their engine's load, a request is routed "no_stats"."""
    poll(lambda: len(metric(url, "shardserve:replica_prefix_cache_queries_total")) == 2, 60,
         "both replicas' load reports at the router")


def test_requests_sharing_a_system_prompt_go_to_one_replica_and_hit_its_prefix_cache(routed, client, offline_llm):
    wait_for_load_reports(routed, client)
    first, home, reason = replica_of(routed, lambda: chat(client, SYSTEM_A, "Why?"))
    assert reason == "least_loaded"
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    for question in ("Who?", "When?", "Where?"):
        reply, replica, reason = replica_of(routed, lambda q=question: chat(client, SYSTEM_A, q))
        assert (replica, reason) == (home, "prefix_hit")
        # everything up to the question's block was computed by the first request on this replica
        assert reply.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 2 * BLOCK
    # greedy text through the ingress is the engine's own
    completion = client.completions.create(model=SERVED_NAME, prompt="Once upon a time", max_tokens=10,
                                           temperature=0)
    expected = offline_llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=10))
    assert completion.choices[0].text == expected[0].outputs[0].text


def wait_for_idle_reports(url: str) -> None:
    """Until both replicas' last reports to the router say their engines are empty: a report is up to a period
    old (longer when Serve's controller lags on a busy machine), and a stale one outweighs remembered prefixes."""
    def idle() -> bool:
        depths = metric(url, "shardserve:replica_reported_queue_depth")
        usage = metric(url, "shardserve:replica_reported_kv_cache_usage")
        return len(depths) == 2 and not any(depths.values()) and not any(usage.values())

    poll(idle, 60, "both replicas reporting an empty engine")


def test_a_new_prefix_goes_to_the_less_loaded_replica(routed, client):
    _, home, _ = replica_of(routed, lambda: chat(client, SYSTEM_A, "Again?"))
    for question in ("Ahoy?", "Treasure?", "Ship?"):
        wait_for_idle_reports(routed)  # then the tie between idle replicas goes to the one with fewer prefixes
        _, other, why = replica_of(routed, lambda q=question: chat(client, SYSTEM_B, q))
        # the reason tells a routing decision (least_loaded, prefix_hit) from Serve's fallback (preferred_busy)
        assert other != home, f"{question} went home ({why})"
    # `other` now holds more prefix blocks than `home`: by remembered prefixes alone, a new prefix would go home

    async def load_home_then_send_new_prefix():
        async with openai.AsyncOpenAI(base_url=f"{routed}/v1", api_key=API_KEY, max_retries=0, timeout=120) as aio:
            async def long_stream():
                stream = await aio.chat.completions.create(
                    model=SERVED_NAME, stream=True, max_tokens=400, temperature=0,
                    extra_body={"ignore_eos": True},
                    messages=[{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": "Sing."}])
                async for _ in stream:
                    pass

            before = routing_counts(routed)[(home, "prefix_hit")]
            busy = [asyncio.create_task(long_stream()) for _ in range(2)]
            await asyncio.to_thread(poll, lambda: routing_counts(routed)[(home, "prefix_hit")] >= before + 2, 60,
                                    "the long streams routed to their prefix's replica")
            before = routing_counts(routed)
            await aio.chat.completions.create(model=SERVED_NAME, max_tokens=4, temperature=0, messages=[
                {"role": "user", "content": "A brand new question that shares no prefix with the others."}])
            after = routing_counts(routed)
            await asyncio.gather(*busy)
            return list((after - before).elements())

    [(replica, reason)] = asyncio.run(load_home_then_send_new_prefix())
    assert (replica, reason) == (other, "least_loaded")


def test_the_turns_of_a_conversation_stay_on_the_replica_that_holds_the_earlier_turns(routed, client):
    for system in (SYSTEM_A + " Conversation one.", SYSTEM_B + " Conversation two."):
        history: list[dict] = []
        replicas, cached = [], []
        for question in ("Hello?", "And then?", "Finally?"):
            reply, replica, _ = replica_of(routed, lambda q=question, s=system, h=history: chat(client, s, q, h))
            replicas.append(replica)
            cached.append(reply.usage.prompt_tokens_details.cached_tokens)
            history += [{"role": "user", "content": question},
                        {"role": "assistant", "content": reply.choices[0].message.content}]
        assert len(set(replicas)) == 1, replicas
        assert cached[0] < cached[1] < cached[2]  # each turn finds the one before it in the cache


def test_when_every_replica_is_full_requests_wait_for_a_slot_and_all_succeed(routed):
    async def burst():
        async with openai.AsyncOpenAI(base_url=f"{routed}/v1", api_key=API_KEY, max_retries=0, timeout=120) as aio:
            return await asyncio.gather(*(
                aio.chat.completions.create(model=SERVED_NAME, max_tokens=40, temperature=0,
                                            extra_body={"ignore_eos": True},
                                            messages=[{"role": "system", "content": SYSTEM_A},
                                                      {"role": "user", "content": f"Count to {i}."}])
                for i in range(4 * MAX_ONGOING)))

    before = routing_counts(routed)
    replies = asyncio.run(burst())
    routed_now = routing_counts(routed) - before
    assert [r.choices[0].finish_reason for r in replies] == ["length"] * 4 * MAX_ONGOING
    # twice what both replicas take at once: the prefix's replica was full, so some went to the other one
    assert sum(routed_now.values()) == 4 * MAX_ONGOING
    assert len({replica for replica, _ in routed_now}) == 2


def test_a_killed_replica_loses_no_request_and_is_forgotten_and_its_prefixes_rehomed(routed, client):
    victims: list[str] = []

    async def requests_across_a_kill():
        async with httpx.AsyncClient(base_url=routed, headers=HEADERS, timeout=120) as http:
            body = {"model": SERVED_NAME, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                    "messages": [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": "Go on."}]}
            before = routing_counts(routed)
            replies = [asyncio.create_task(http.post("/v1/chat/completions", json=body)) for _ in range(MAX_ONGOING)]
            accepted = await asyncio.to_thread(
                poll, lambda: (c := routing_counts(routed) - before).total() == MAX_ONGOING and c, 60,
                "every request accepted by a replica")
            # the replica that took the most of them (all of them, unless the first were still running)
            victims.append(Counter({replica: n for (replica, _), n in accepted.items()}).most_common(1)[0][0])
            [actor] = [a for a in alive_actors() if a["Name"].endswith(f"#{victims[0]}")]
            os.kill(actor["Pid"], signal.SIGKILL)
            return await asyncio.gather(*replies)

    replies = asyncio.run(requests_across_a_kill())
    [victim] = victims
    # none had answered when the replica died: the ingress sent each of them to the other replica
    assert [r.status_code for r in replies] == [200] * MAX_ONGOING, [r.text[:200] for r in replies]
    assert all(r.json()["usage"]["completion_tokens"] == 400 for r in replies)
    assert metric(routed, "shardserve:routing_retries_total")[""] >= 1
    poll(lambda: victim not in {replica for replica, _ in routing_counts(routed)}, 30,
         "the killed replica's series to leave /metrics")
    # its prefix is re-homed on the survivor, and stays there once Serve has replaced the dead replica
    _, survivor, reason = replica_of(routed, lambda: chat(client, SYSTEM_A, "After the fault?"))
    assert survivor != victim and reason in ("prefix_hit", "least_loaded")
    poll(lambda: len(metric(routed, "shardserve:replica_prefix_cache_queries_total")) == 2, 90,
         "Serve's replacement of the killed replica")
    for question in ("Still there?", "And now?"):
        _, replica, reason = replica_of(routed, lambda q=question: chat(client, SYSTEM_A, q))
        assert (replica, reason) == (survivor, "prefix_hit")
