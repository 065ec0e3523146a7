"""A replica's drain (app/drain.py) without Ray: the gate, the wait-then-abort rule, the drain board's bookkeeping
(on a key-value store in memory in place of the GCS's), a replica's part in a drain, and what a request aborted at the
deadline returns. tests/app/test_cli_serve.py drains a real server through the GCS."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from app.config import ServeArgs
from app.deployment import build_replica_app
from app.drain import (
    ABORT_GRACE_S,
    DrainBoard,
    DrainGate,
    DrainState,
    ReplicaDrain,
    bounded,
    finish_in_flight,
)
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


class MemoryKeyValue:
    """The GCS's key-value store as the board uses it, in a dict."""

    def __init__(self):
        self.items: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self.items.get(key)

    def put(self, key: str, value: bytes, overwrite: bool = True) -> None:
        if overwrite or key not in self.items:
            self.items[key] = value

    def delete(self, key: str, by_prefix: bool = False) -> None:
        for name in [name for name in self.items if (name.startswith(key) if by_prefix else name == key)]:
            del self.items[name]

    def keys(self, prefix: str) -> list[str]:
        return [name for name in self.items if name.startswith(prefix)]


def test_the_board_holds_the_timeout_and_which_replicas_drained():
    store = MemoryKeyValue()
    board = DrainBoard("app", store)
    assert not board.is_open()  # `serve run`: replicas leave the drain to Serve
    store.put("drain/app/open/stale", b"1")  # an earlier CLI's, on a cluster this one joined
    board.open()
    assert board.is_open() and board.pending() == []
    board.register("a")
    board.register("b")
    assert board.began() is None  # nothing happens before the signal
    board.begin(30.0)
    board.begin(0.0)  # a second begin keeps the first timeout
    assert board.began() == 30.0
    assert board.pending() == ["a", "b"]
    board.report_drained("a")
    board.unregister("b")  # Serve stopped it: nothing to wait for
    assert board.pending() == []
    assert DrainBoard("other-app", store).began() is None  # each application has its own drain
    board.close()
    assert store.items == {}


def test_the_drain_waits_only_for_replicas_serve_still_lists():
    # a replica that died (its engine, a TP worker, its node) never unregisters nor reports
    board = DrainBoard("app", MemoryKeyValue())
    board.open()
    for replica in ("dead", "replacement", "other"):
        board.register(replica)
    board.report_drained("other")
    assert board.pending(live=["replacement", "other", "ingress"]) == ["replacement"]
    assert board.pending() == ["dead", "replacement"]


def test_a_replica_drains_when_the_board_says_so_and_reports_it():
    board = DrainBoard("app", MemoryKeyValue())
    board.open()
    state = DrainState(in_flight=1)
    aborts = []

    def abort_all():
        aborts.append(1)
        state.in_flight = 0

    drain = ReplicaDrain(board, "r1", state, abort_all, poll_s=0.01)
    deadline = time.monotonic() + 5
    while board.pending() != ["r1"]:  # registered, waiting
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.05)
    assert not state.draining  # it admits requests until the board says otherwise
    board.begin(0.2)
    drain.thread.join(timeout=5)
    assert not drain.thread.is_alive()
    assert state.draining and aborts  # the request still open at the deadline was aborted
    assert board.pending() == []  # and the replica reported


def test_a_detached_replica_stops_looking_and_leaves_the_board():
    board = DrainBoard("app", MemoryKeyValue())
    board.open()
    drain = ReplicaDrain(board, "r1", DrainState(), lambda: None, poll_s=0.01)
    deadline = time.monotonic() + 5
    while board.pending() != ["r1"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    drain.detach()
    drain.thread.join(timeout=5)
    assert not drain.thread.is_alive()
    assert board.pending() == []


def test_a_call_to_the_cluster_is_given_up_once_the_cluster_is_gone_or_after_its_bound():
    import ray

    assert bounded(lambda: 7, lambda: True) == 7
    with pytest.raises(KeyError):  # the call's own error, on the caller's thread
        bounded(lambda: {}["missing"], lambda: True)
    blocked = threading.Event()  # a call into a GCS that is going away, which Ray would hold for a minute
    alive = [True]
    threading.Timer(0.2, lambda: alive.__setitem__(0, False)).start()
    started = time.monotonic()
    with pytest.raises(ray.exceptions.RaySystemError):
        bounded(blocked.wait, lambda: alive[0], timeout_s=30)
    assert time.monotonic() - started < 5
    started = time.monotonic()
    with pytest.raises(ray.exceptions.GetTimeoutError):  # a cluster of others' (always "alive" to us)
        bounded(blocked.wait, lambda: True, timeout_s=0.3)
    assert time.monotonic() - started < 5
    blocked.set()


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
