"""A replica's drain (app/drain.py) without Ray: the gate, the wait-then-abort rule, the coordinator's bookkeeping,
and what a request aborted at the deadline returns."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from app.config import ServeArgs
from app.deployment import build_replica_app
from app.drain import ABORT_GRACE_S, DrainCoordinator, DrainGate, DrainState, finish_in_flight
from app.observability.replica import ReplicaObservability
from engine import AsyncLLMEngine
from engine.config import EngineConfig
from tests.app.fake_engine import FakeEngine

MODEL = "fake-model"


def gated_client(engine, state: DrainState) -> httpx.AsyncClient:
    app = build_replica_app(engine, ServeArgs(model=MODEL, max_waiting_requests=4),
                            ReplicaObservability(engine, MODEL), drain_state=state)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def test_a_draining_replica_answers_new_requests_503_with_retry_after_in_openai_shape():
    state = DrainState()
    async with gated_client(FakeEngine(), state) as client:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        state.draining = True
        refused = await client.post("/v1/completions", json=body)
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("service_unavailable_error", "server_shutting_down")
        assert "shutting down" in error["message"]
        assert (await client.post("/v1/chat/completions", json={"model": MODEL, "messages": []})).status_code == 503
        assert (await client.get("/health")).status_code == 200  # probes still answer while in-flight work ends
    assert state.in_flight == 0


async def test_the_gate_counts_a_request_as_in_flight_until_its_response_is_sent():
    state = DrainState()
    release = asyncio.Event()

    async def slow_app(scope, receive, send):
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=DrainGate(slow_app, state)),
                                 base_url="http://test") as client:
        request = asyncio.create_task(client.get("/v1/models"))
        while state.in_flight == 0:
            await asyncio.sleep(0.01)
        state.draining = True  # a request admitted before the drain runs on
        release.set()
        assert (await request).status_code == 200
    assert state.in_flight == 0


def test_a_drain_waits_for_open_requests_that_end_before_the_deadline_and_aborts_none():
    state = DrainState(in_flight=1)
    aborts = []
    threading.Timer(0.2, lambda: setattr(state, "in_flight", 0)).start()
    started = time.monotonic()
    assert finish_in_flight(state, lambda: aborts.append(1), timeout_s=10) == 0
    assert state.draining and not aborts
    assert time.monotonic() - started < 5


def test_a_drain_aborts_what_is_still_open_at_the_deadline():
    state = DrainState(in_flight=2)

    def abort_all():  # the engine ends both streams; their responses close
        state.in_flight = 0

    started = time.monotonic()
    assert finish_in_flight(state, abort_all, timeout_s=0.3) == 2
    assert state.in_flight == 0
    assert 0.3 <= time.monotonic() - started < ABORT_GRACE_S


async def test_the_coordinator_hands_out_the_time_left_and_tracks_which_replicas_drained():
    coordinator = DrainCoordinator()
    coordinator.register("a")
    coordinator.register("b")
    waiting = asyncio.create_task(coordinator.wait_for_drain())
    await asyncio.sleep(0.05)
    assert not waiting.done()  # nothing happens before the signal
    coordinator.begin(30.0)
    assert 29.0 < await waiting <= 30.0
    coordinator.begin(0.0)  # a second begin keeps the first deadline
    assert 29.0 < await coordinator.wait_for_drain() <= 30.0
    assert coordinator.pending() == ["a", "b"]
    coordinator.report_drained("a")
    coordinator.unregister("b")  # Serve stopped it: nothing to wait for
    assert coordinator.pending() == []


def test_the_drain_waits_only_for_replicas_serve_still_lists():
    # a replica that died (its engine, a TP worker, its node) never unregisters nor reports
    coordinator = DrainCoordinator()
    for replica in ("dead", "replacement", "other"):
        coordinator.register(replica)
    coordinator.report_drained("other")
    assert coordinator.pending(live=["replacement", "other", "ingress"]) == ["replacement"]
    assert coordinator.pending() == ["dead", "replacement"]


async def test_a_request_aborted_at_the_deadline_returns_its_partial_text_with_finish_reason_abort(tiny_llama_dir):
    """What a non-streaming client sees when the drain's deadline passes: 200, the text so far, "abort"."""
    async with AsyncLLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32")) as engine:
        app = build_replica_app(engine, ServeArgs(model=str(tiny_llama_dir), served_model_name=MODEL),
                                ReplicaObservability(engine, MODEL))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60) as client:
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True,
                    "temperature": 0}
            request = asyncio.create_task(client.post("/v1/completions", json=body))
            while engine.stats().num_running == 0:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)
            engine.abort_all()
            response = await request
    assert response.status_code == 200
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] == "abort"
    assert 0 < response.json()["usage"]["completion_tokens"] < 900
    assert choice["text"]
