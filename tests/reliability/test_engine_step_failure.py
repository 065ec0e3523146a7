"""An exception in an engine step: every request in flight ends at once with an error, and /health and new
requests answer 503 with Retry-After in OpenAI's error shape, never a hang.

In process, without Ray: the real AsyncLLMEngine on the tiny model behind the replica's app
(build_replica_app). The fault is injected by replacing that engine's `step` for the test (no production
flag), as a device error would surface: an exception out of `step()` on the loop thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable

import httpx
import pytest

from app.config import ServeArgs
from app.deployment import build_replica_app
from app.observability.replica import ReplicaObservability
from engine import AsyncLLMEngine, EngineConfig, EngineDeadError, SamplingParams, async_engine
from engine.llm_engine import LLMEngine

MODEL = "tiny"
# a bound against hangs: everything below answers within a few engine steps
ANSWER_TIMEOUT_S = 60


def fail_steps_when(engine: AsyncLLMEngine, condition: Callable[[LLMEngine], bool]) -> None:
    """From the first step at which `condition(engine)` holds, the step raises instead of running."""
    step = engine.engine.step

    def step_or_fail():
        if condition(engine.engine):
            raise RuntimeError("injected device failure")
        return step()

    engine.engine.step = step_or_fail


@pytest.fixture
async def served(tiny_llama_dir):
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256))
    settings = ServeArgs(model=str(tiny_llama_dir), served_model_name=MODEL, max_waiting_requests=16)
    app = build_replica_app(engine, settings, ReplicaObservability(engine, MODEL))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        yield engine, client
    await asyncio.to_thread(engine.shutdown)


def completion(max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def sse_data(body: str) -> list[str]:
    return [frame[len("data: "):] for frame in body.split("\n\n") if frame.startswith("data: ")]


def assert_engine_dead_503(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert int(response.headers["retry-after"]) >= 1
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable_error", "engine_dead")
    assert "injected device failure" in error["message"]


async def test_a_failing_step_ends_every_request_in_flight_and_the_server_answers_503_with_retry_after(served):
    engine, client = served
    # both requests are running and the stream has tokens out when the step fails
    fail_steps_when(engine, lambda e: e.stats().num_running == 2 and e.num_steps >= 4)

    streamed, plain = await asyncio.wait_for(asyncio.gather(
        client.post("/v1/completions", json=completion(200, stream=True)),
        client.post("/v1/completions", json=completion(200, stream=False)),
    ), ANSWER_TIMEOUT_S)

    assert streamed.status_code == 200
    events = sse_data(streamed.text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["type"], error["code"]) == ("service_unavailable_error", "engine_dead")
    assert "injected device failure" in error["message"]
    chunks = [json.loads(data) for data in events[:-2]]
    assert chunks and all(c["choices"][0]["finish_reason"] is None for c in chunks)  # cut, not finished
    assert_engine_dead_503(plain)  # non-streaming: nothing was sent yet, so a plain 503

    assert not engine.is_running
    health = await client.get("/health")
    assert health.status_code == 503
    for stream in (False, True):  # a new request, streaming or not, is refused before anything starts
        assert_engine_dead_503(await asyncio.wait_for(
            client.post("/v1/completions", json=completion(4, stream=stream)), ANSWER_TIMEOUT_S))


async def test_a_request_that_passed_the_running_check_as_the_loop_died_is_refused_not_left_waiting(
    tiny_llama_dir, monkeypatch
):
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256))
    try:
        fail_steps_when(engine, lambda e: True)
        params = SamplingParams(max_tokens=4)
        with pytest.raises(EngineDeadError, match="injected device failure"):
            async for _ in engine.generate([5, 6, 7], params, "first"):
                pass
        await asyncio.to_thread(engine.loop_thread.join, ANSWER_TIMEOUT_S)  # it has failed its streams and left
        assert not engine.loop_thread.is_alive()

        # the moment of the race: `generate` checked is_running just before the loop died
        monkeypatch.setattr(AsyncLLMEngine, "is_running", property(lambda self: True))
        with pytest.raises(EngineDeadError, match="injected device failure"):
            await asyncio.wait_for(anext(engine.generate([5, 6, 7], params, "late")), ANSWER_TIMEOUT_S)
    finally:
        monkeypatch.undo()
        engine.shutdown()


async def test_on_dead_hears_of_a_failure_once_and_never_of_a_shutdown(tiny_llama_dir):
    told: list[str] = []
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256)
    engine = AsyncLLMEngine(config, on_dead=told.append)
    fail_steps_when(engine, lambda e: True)
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=4), "doomed"):
            pass
    await asyncio.to_thread(engine.loop_thread.join, ANSWER_TIMEOUT_S)  # on_dead runs as the loop leaves
    assert len(told) == 1 and "injected device failure" in told[0]

    shut_down = AsyncLLMEngine(config, on_dead=told.append)
    await asyncio.to_thread(shut_down.shutdown)
    assert len(told) == 1


async def test_a_dead_engine_restarts_in_place_behind_the_same_app_and_serves_again(served):
    engine, client = served
    dead_steps = engine.recent_steps
    with pytest.raises(RuntimeError, match="only an engine that a failure ended restarts"):
        engine.restart()
    fail_steps_when(engine, lambda e: True)
    assert_engine_dead_503(await asyncio.wait_for(client.post("/v1/completions", json=completion(4, stream=False)),
                                                  ANSWER_TIMEOUT_S))
    dead_thread = engine.loop_thread
    await asyncio.to_thread(dead_thread.join, ANSWER_TIMEOUT_S)

    await asyncio.to_thread(engine.restart)  # app/engine_recovery.py calls it from the dead loop's on_dead

    assert engine.is_running and engine.loop_thread is not dead_thread and engine.recent_steps is not dead_steps
    answer = await asyncio.wait_for(client.post("/v1/completions", json=completion(4, stream=False)), ANSWER_TIMEOUT_S)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
    assert (await client.get("/health")).status_code == 200
    manager = engine.engine.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks


async def test_an_engine_shut_down_while_it_is_rebuilt_does_not_come_back(tiny_llama_dir, monkeypatch):
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256)
    engine = AsyncLLMEngine(config)
    fail_steps_when(engine, lambda e: True)
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=4), "doomed"):
            pass
    await asyncio.to_thread(engine.loop_thread.join, ANSWER_TIMEOUT_S)
    real_loop = async_engine._EngineLoop

    def shut_down_while_building(*args):  # the shutdown lands while the new engine is being built
        engine.shutdown()
        return real_loop(*args)

    monkeypatch.setattr(async_engine, "_EngineLoop", shut_down_while_building)
    with pytest.raises(EngineDeadError, match="shut down while it was rebuilt"):
        await asyncio.to_thread(engine.restart)
    assert not engine.is_running
    assert not any(thread.name == "shardserve-engine-loop" and thread.is_alive() for thread in threading.enumerate())
