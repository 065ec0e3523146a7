"""The ingress's app (app/ingress.py) in front of replicas that answer through their real HTTP app
(app/forwarding.py answer_forwarded over build_replica_app and a fake engine), without Ray: what it routes by,
that its answers are the replica's own, re-sends after a lost replica, backpressure, a client that leaves,
/metrics and its span."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError

from app.config import ServeArgs
from app.deployment import build_replica_app
from app.drain import DrainState
from app.forwarding import ForwardedRequest, answer_forwarded
from app.ingress import MAX_ATTEMPTS, IngressApp, IngressSettings
from app.observability.replica import ReplicaObservability
from app.observability.routing import IngressMetrics
from app.observability.tracing import TRACER_NAME, make_tracer_provider
from app.prompts import chat_prompt
from app.protocol import ChatCompletionRequest
from app.routing.block_hashes import prompt_block_hashes
from app.routing.request import RoutedRequest
from app.routing.router import RoutingDecision
from app.routing.telemetry import RoutingTelemetry
from tests.app.asgi_stream import StreamingPost
from tests.app.fake_engine import ByteTokenizer, FakeEngine

MODEL = "fake-model"
BLOCK = 4
KEY = "secret"
AUTH = {"authorization": f"Bearer {KEY}"}


class SlowFakeEngine(FakeEngine):
    """A fake engine that takes 10 ms per token, so that a stream is still running when its client leaves."""

    async def generate(self, *args, **kwargs):
        async for delta in super().generate(*args, **kwargs):
            await asyncio.sleep(0.01)
            yield delta


class Replicas:
    """Engine replicas as the ingress calls them: each call goes to the next replica (round robin) and is
    answered by that replica's own HTTP app. `faults` scripts the calls: "lost" (the replica is gone before it
    answers), "lost-mid" (it dies after its first body write), "dead-engine" (its engine died: it answers 503
    engine_dead), "backpressure" (Serve's router queue is full)."""

    def __init__(self, num: int = 2, engine_type=FakeEngine, exporter=None, telemetry: RoutingTelemetry | None = None):
        self.engines = [engine_type(max_model_len=64) for _ in range(num)]
        self.observability = [ReplicaObservability(e, MODEL, f"replica-{i}", span_exporter=exporter)
                              for i, e in enumerate(self.engines)]
        self.drain_states = [DrainState() for _ in range(num)]
        settings = ServeArgs(model=MODEL, api_key=KEY, max_request_body_bytes=2048)
        self.apps = [build_replica_app(e, settings, obs, drain)
                     for e, obs, drain in zip(self.engines, self.observability, self.drain_states, strict=True)]
        self.calls: list[tuple[RoutedRequest, ForwardedRequest, int]] = []
        self.faults: list[str | None] = []
        self.telemetry = telemetry

    async def __call__(self, routed: RoutedRequest, request: ForwardedRequest):
        index = len(self.calls) % len(self.apps)
        self.calls.append((routed, request, index))
        fault = self.faults.pop(0) if self.faults else None
        if fault == "backpressure":
            raise BackPressureError(num_queued_requests=8, max_queued_requests=8)
        if self.telemetry is not None:  # what the router would report for this call
            self.telemetry.on_decision(RoutingDecision(routed.request_id, f"replica-{index}", "prefix_hit", 2, 1.0,
                                                       len(routed.block_hashes)))
        if fault == "lost":
            raise ActorDiedError()
        if fault == "dead-engine":
            self.engines[index].fail_with = _engine_dead()
        async for message in answer_forwarded(self.apps[index], request):
            yield message
            if fault == "lost-mid" and message["type"] == "http.response.body" and message.get("body"):
                raise ActorDiedError()


def _engine_dead():
    from engine.errors import EngineDeadError

    return EngineDeadError("injected")


def make_ingress(replicas: Replicas, tracer=None, telemetry: RoutingTelemetry | None = None) -> IngressApp:
    telemetry = telemetry or replicas.telemetry or RoutingTelemetry()
    return IngressApp(replicas, ByteTokenizer(), IngressSettings(BLOCK, 2048, KEY), telemetry,
                      IngressMetrics(telemetry, MODEL), tracer)


def client_of(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress")


def chat(content: str, **fields) -> dict:
    return {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": content}],
            **fields}


def retries(metrics_text: str) -> float:
    return next(s.value for family in text_string_to_metric_families(metrics_text) for s in family.samples
                if s.name == "shardserve:routing_retries_total")


async def test_a_chat_is_routed_by_the_block_hashes_of_the_prompt_the_replica_runs():
    replicas = Replicas()
    async with client_of(make_ingress(replicas)) as client:
        r = await client.post("/v1/chat/completions", json=chat("x" * 40), headers=AUTH)
        assert r.status_code == 200, r.text
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "y" * 9, "max_tokens": 2},
                          headers=AUTH)
    ids = chat_prompt(ByteTokenizer(), ChatCompletionRequest.model_validate(chat("x" * 40))).token_ids
    [(chat_routed, _, _), (completion_routed, _, _)] = replicas.calls
    assert len(ids) // BLOCK == len(chat_routed.block_hashes) > 10
    assert chat_routed.block_hashes == prompt_block_hashes(ids, BLOCK)
    assert completion_routed.block_hashes == prompt_block_hashes(list(b"y" * 9), BLOCK)
    assert chat_routed.request_id and chat_routed.request_id != completion_routed.request_id


async def test_without_the_api_key_or_a_valid_body_a_request_carries_no_prompt_and_gets_the_replicas_answer():
    replicas = Replicas()
    async with client_of(make_ingress(replicas)) as client:
        unauthorized = await client.post("/v1/chat/completions", json=chat("x" * 40))
        bad_json = await client.post("/v1/completions", content=b"{not json", headers=AUTH)
        bad_field = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": []}, headers=AUTH)
        models = await client.get("/v1/models", headers=AUTH)
    assert [routed.block_hashes for routed, _, _ in replicas.calls] == [()] * 4
    assert (unauthorized.status_code, unauthorized.json()["error"]["code"]) == (401, "invalid_api_key")
    assert (bad_json.status_code, bad_json.json()["error"]["type"]) == (400, "invalid_request_error")
    assert bad_field.status_code == 400 and bad_field.json()["error"]["param"] == "messages"
    assert models.json()["data"][0]["id"] == MODEL


async def test_a_body_over_the_limit_is_not_read_whole_and_the_replica_answers_413():
    replicas = Replicas()
    async with client_of(make_ingress(replicas)) as client:
        declared = await client.post("/v1/completions", content=b"x" * 5000, headers=AUTH)

        async def chunks():
            for _ in range(10):
                yield b"x" * 1000

        streamed = await client.post("/v1/completions", content=chunks(), headers=AUTH)
    assert [r.status_code for r in (declared, streamed)] == [413, 413]
    assert [len(request.body) for _, request, _ in replicas.calls] == [0, 2049]


async def test_forwarded_answers_are_the_replicas_own_streams_included():
    replicas = Replicas(num=1)
    direct = client_of(replicas.apps[0])
    async with client_of(make_ingress(replicas)) as client, direct:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 6, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        via_ingress = await client.post("/v1/completions", json=body, headers=AUTH)
        straight = await direct.post("/v1/completions", json=body, headers=AUTH)
    assert via_ingress.status_code == straight.status_code == 200
    assert via_ingress.headers["content-type"].startswith("text/event-stream")

    def texts(response):
        events = [e[len("data: "):] for e in response.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        return "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), chunks[-1]["usage"]

    assert texts(via_ingress) == texts(straight)


async def test_a_request_whose_replica_is_lost_before_answering_is_sent_to_another():
    replicas = Replicas(num=3, telemetry=RoutingTelemetry())
    replicas.faults = ["lost", "dead-engine"]
    async with client_of(make_ingress(replicas)) as client:
        r = await client.post("/v1/chat/completions", json=chat("hi"), headers=AUTH)
        metrics = (await client.get("/metrics")).text
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    calls = [routed for routed, _, _ in replicas.calls]
    assert len(calls) == 3 and {(c.request_id, c.block_hashes) for c in calls} == {
        (calls[0].request_id, calls[0].block_hashes)}  # the same request each time
    # each call asks the router to avoid the replicas that lost it before
    assert [c.avoid for c in calls] == [(), ("replica-0",), ("replica-0", "replica-1")]
    assert retries(metrics) == 2


async def test_a_request_that_loses_every_replica_it_is_sent_to_gets_503_replica_lost():
    replicas = Replicas()
    replicas.faults = ["lost"] * MAX_ATTEMPTS
    async with client_of(make_ingress(replicas)) as client:
        r = await client.post("/v1/chat/completions", json=chat("hi"), headers=AUTH)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "replica_lost"
    assert len(replicas.calls) == MAX_ATTEMPTS


async def test_a_stream_whose_replica_dies_after_it_started_ends_with_an_error_event_and_done():
    replicas = Replicas()
    replicas.faults = ["lost-mid"]
    async with client_of(make_ingress(replicas)) as client:
        r = await client.post("/v1/chat/completions", json=chat("hi", max_tokens=30, stream=True), headers=AUTH)
    events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
    assert r.status_code == 200
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "replica_lost"
    assert len(replicas.calls) == 1  # what the client already read cannot be sent again


async def test_a_503_that_is_not_a_dead_engine_is_the_clients_answer():
    replicas = Replicas()
    for state in replicas.drain_states:  # both replicas draining (app/drain.py)
        state.draining = True
    async with client_of(make_ingress(replicas)) as client:
        r = await client.post("/v1/chat/completions", json=chat("hi"), headers=AUTH)
    assert (r.status_code, r.json()["error"]["code"]) == (503, "server_shutting_down")
    assert len(replicas.calls) == 1


async def test_a_full_router_queue_is_an_openai_429_with_retry_after():
    replicas = Replicas()
    replicas.faults = ["backpressure"]
    async with client_of(make_ingress(replicas)) as client:
        r = await client.post("/v1/chat/completions", json=chat("hi"), headers=AUTH)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "rate_limit_error", "param": None,
                                 "code": "server_overloaded"}


async def test_a_client_that_leaves_mid_stream_ends_the_replicas_engine_request():
    replicas = Replicas(num=1, engine_type=SlowFakeEngine)
    post = StreamingPost(make_ingress(replicas), "/v1/completions",
                         {"model": MODEL, "prompt": "hi", "max_tokens": 50, "stream": True}, headers=AUTH)
    assert await post.status() == 200
    assert await post.next_write()
    engine = replicas.engines[0]
    assert engine.stats_now.num_running == 1
    await post.leave()
    for _ in range(100):
        if engine.stats_now.num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.stats_now.num_running == 0
    assert engine.num_generated_tokens < 50


async def test_metrics_show_each_replicas_routing_and_its_reported_prefix_cache_hits():
    telemetry = RoutingTelemetry()
    replicas = Replicas(telemetry=telemetry)
    async with client_of(make_ingress(replicas)) as client:
        for _ in range(3):
            await client.post("/v1/chat/completions", json=chat("z" * 16), headers=AUTH)
        telemetry.on_replica_stats({"replica-0": {"prefix_cache_queries": 80.0, "prefix_cache_hits": 60.0},
                                    "replica-1": {"prefix_cache_queries": 40.0, "prefix_cache_hits": 0.0}})
        samples = {(s.name, s.labels.get("replica"), s.labels.get("reason")): s.value
                   for family in text_string_to_metric_families((await client.get("/metrics")).text)
                   for s in family.samples}
        telemetry.on_replica_stats({"replica-1": {}})  # replica-0 left
        after = (await client.get("/metrics")).text
    assert samples[("shardserve:routing_decisions_total", "replica-0", "prefix_hit")] == 2
    assert samples[("shardserve:routing_decisions_total", "replica-1", "prefix_hit")] == 1
    blocks = len(replicas.calls[0][0].block_hashes)
    assert samples[("shardserve:routing_prompt_blocks_total", "replica-0", None)] == 2 * blocks
    assert samples[("shardserve:routing_matched_blocks_total", "replica-0", None)] == 2 * 2
    assert samples[("shardserve:replica_prefix_cache_hits_total", "replica-0", None)] == 60
    assert samples[("shardserve:replica_prefix_cache_queries_total", "replica-1", None)] == 40
    assert 'replica="replica-0"' not in after and 'replica="replica-1"' in after


async def test_metrics_show_the_prefix_blocks_the_router_holds_per_replica_until_it_forgets_them():
    telemetry = RoutingTelemetry()
    async with client_of(make_ingress(Replicas(telemetry=telemetry))) as client:
        telemetry.on_prefix_index({"replica-0": 12, "replica-1": 3})
        held = await prefix_blocks(client)
        telemetry.on_prefix_index({"replica-1": 3})  # replica-0 left: the router forgot its prefixes
        after = await prefix_blocks(client)
    assert held == {"replica-0": 12, "replica-1": 3}
    assert after == {"replica-1": 3}


async def prefix_blocks(client) -> dict[str, float]:
    return {s.labels["replica"]: s.value
            for family in text_string_to_metric_families((await client.get("/metrics")).text)
            for s in family.samples if s.name == "shardserve:routing_prefix_blocks"}


async def test_the_ingress_span_names_the_routing_decision_and_parents_the_replicas_spans():
    exporter = InMemorySpanExporter()
    provider = make_tracer_provider(None, exporter=exporter)
    telemetry = RoutingTelemetry()
    replicas = Replicas(num=1, exporter=exporter, telemetry=telemetry)
    async with client_of(make_ingress(replicas, provider.get_tracer(TRACER_NAME))) as client:
        r = await client.post("/v1/chat/completions", json=chat("w" * 20), headers=AUTH)
        assert r.status_code == 200
    provider.force_flush()
    replicas.observability[0].tracer_provider.force_flush()
    spans = exporter.get_finished_spans()
    [ingress] = [s for s in spans if s.name == "POST /v1/chat/completions"]
    assert ingress.attributes["shardserve.routing.reason"] == "prefix_hit"
    assert ingress.attributes["shardserve.routing.replica"] == "replica-0"
    assert ingress.attributes["shardserve.routing.prompt_blocks"] == len(replicas.calls[0][0].block_hashes) > 0
    assert ingress.attributes["shardserve.routing.attempts"] == 1
    assert ingress.attributes["http.response.status_code"] == 200
    replica_server = [s for s in spans if s.name == f"chat {MODEL}"]
    assert replica_server and replica_server[0].parent.span_id == ingress.context.span_id
    assert replica_server[0].context.trace_id == ingress.context.trace_id


@pytest.mark.parametrize("root_path", ["", "/routed"])
async def test_a_forwarded_request_keeps_the_path_within_the_application(root_path):
    scope = {"type": "http", "method": "POST", "path": f"{root_path}/v1/completions", "root_path": root_path,
             "query_string": b"a=1", "headers": [(b"host", b"x"), (b"traceparent", b"old")], "client": ("1.2.3.4", 5)}
    request = ForwardedRequest.from_scope(scope, b"{}", {"traceparent": "new"})
    assert request.path == "/v1/completions" and request.query_string == b"a=1"
    assert dict(request.headers) == {b"host": b"x", b"traceparent": b"new"}
    assert request.scope()["client"] == ("1.2.3.4", 5)
