"""A replica whose engine or process dies: the client learns at once (never a hang), a replica whose engine
died rebuilds it in place, or, where it died again soon after a rebuild, exits by itself once its requests have
their error (app/engine_recovery.py), and Serve brings a healthy one back.

The tiny model behind the session's Serve cluster (127.0.0.1 only), one application per fault. Faults are
SIGKILLs of processes this cluster started: a tensor-parallel worker actor, or the replica itself. Recovery
is polled against a deadline that only guards against hangs; the times themselves are figures (the stress
versions, `make stress`, and docs/OPERATIONS.md), never asserts.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from app.proxy_errors import OpenAIErrorsFromServe
from tests.app.conftest import SERVED_NAME, tiny_serve_args
from tests.reliability.chaos import (
    PROBE_TIMEOUT_S,
    completion_body,
    death_cause_of,
    replica_actor,
    seconds_to_first_success,
    stream_cut_by,
    tp_worker_actors,
    wait_until_running,
)

RECOVERY_DEADLINE_S = 240  # kill to first success, however slow this machine is; a hang fails here
LONG_STREAM_TOKENS = 400  # far more than the engine makes before the kill lands


def deploy(serve_cluster, model_dir, app: str, **overrides) -> str:
    """The tiny model as application `app` at route /<app> (no API key); returns its base URL."""
    from ray import serve

    from app.deployment import build_app

    serve.run(build_app(tiny_serve_args(model_dir, api_key=None, **overrides)), name=app, route_prefix=f"/{app}")
    return serve_cluster.url(f"/{app}")


def sigkill_with_two_in_flight(base: str, pid: int, at: list[float]):
    """The fault: once the stream and a plain request both run in the engine, SIGKILL `pid`."""
    def fault() -> None:
        wait_until_running(base, 2)
        os.kill(pid, signal.SIGKILL)
        at.append(time.monotonic())

    return fault


def assert_503_with_retry_after(response: httpx.Response, code: str) -> None:
    assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1, response.text
    assert response.json()["error"]["code"] == code


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_tp_worker_killed_mid_stream_fails_the_stream_at_once_and_the_replica_rebuilds_its_engine(
    serve_cluster, tiny_llama_dir, figures
):
    from ray import serve

    app = "chaos-tp-worker"
    base = deploy(serve_cluster, tiny_llama_dir, app, tensor_parallel_size=2)
    try:
        replica = replica_actor(app)
        [worker] = tp_worker_actors(replica)
        killed_at: list[float] = []
        with ThreadPoolExecutor(1) as pool:
            plain = pool.submit(httpx.post, f"{base}/v1/completions", json=completion_body(SERVED_NAME, LONG_STREAM_TOKENS),
                                timeout=PROBE_TIMEOUT_S)
            end = stream_cut_by(f"{base}/v1/completions",
                                completion_body(SERVED_NAME, LONG_STREAM_TOKENS, stream=True),
                                sigkill_with_two_in_flight(base, worker["Pid"], killed_at))
            plain_answer = plain.result()

        # the stream ends with an OpenAI error event and [DONE], not a broken connection or a hang
        assert end.transport_error is None, end
        assert end.events[-1] == "[DONE]" and end.finish_reasons == [], end
        assert (end.error["type"], end.error["code"]) == ("service_unavailable_error", "engine_dead"), end
        assert "worker rank 1 died" in end.error["message"]
        assert_503_with_retry_after(plain_answer, "engine_dead")  # the request in flight without a stream

        # the same replica process serves again, with a new worker (app/engine_recovery.py: no new replica)
        record_recovery(base, end, killed_at[0], figures, "rebuilt in place")
        assert (replica_actor(app)["ActorID"], replica_actor(app)["Pid"]) == (replica["ActorID"], replica["Pid"])
        [new_worker] = tp_worker_actors(replica)
        assert new_worker["Pid"] != worker["Pid"]

        # killed again this soon after the rebuild: the replica's process exits by itself rather than waiting for
        # three failed health checks (after which Serve's controller would kill it), and Serve replaces it
        os.kill(new_worker["Pid"], signal.SIGKILL)
        killed_again_at = time.monotonic()
        cause = death_cause_of(replica["ActorID"], PROBE_TIMEOUT_S)
        assert "WORKER_DIED" in cause and "RAY_KILL" not in cause, cause
        seconds, answers = seconds_to_first_success(f"{base}/v1/completions", completion_body(SERVED_NAME, 4),
                                                    killed_again_at, RECOVERY_DEADLINE_S)
        figures.append(f"killed again: first success {seconds:.1f} s after it, from a new replica "
                       f"({len(answers)} failed probes before)")
    finally:
        serve.delete(app)


def record_recovery(base: str, end, killed_at: float, figures: list[str], how: str = "from a new replica") -> None:
    """Wait for the first request through `base` that succeeds after the kill; /health is 200 again then."""
    seconds, answers = seconds_to_first_success(f"{base}/v1/completions", completion_body(SERVED_NAME, 4),
                                                killed_at, RECOVERY_DEADLINE_S)
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    figures.append(f"stream ended {end.seconds_after_fault:.2f} s after the kill; first success "
                   f"{seconds:.1f} s after it, {how} ({len(answers)} failed probes before)")


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_replica_killed_mid_stream_ends_the_stream_and_serve_replaces_the_replica(
    serve_cluster, tiny_llama_dir, figures
):
    from ray import serve

    app = "chaos-replica"
    base = deploy(serve_cluster, tiny_llama_dir, app)
    try:
        killed_at: list[float] = []
        with ThreadPoolExecutor(1) as pool:
            plain = pool.submit(httpx.post, f"{base}/v1/completions", json=completion_body(SERVED_NAME, LONG_STREAM_TOKENS),
                                timeout=PROBE_TIMEOUT_S)
            end = stream_cut_by(f"{base}/v1/completions",
                                completion_body(SERVED_NAME, LONG_STREAM_TOKENS, stream=True),
                                sigkill_with_two_in_flight(base, replica_actor(app)["Pid"], killed_at))
            plain_answer = plain.result()

        # the replica cannot say it any more: the proxy's middleware (app/proxy_errors.py) ends both requests
        assert end.transport_error is None, end
        assert end.events[-1] == "[DONE]" and end.finish_reasons == [], end
        assert (end.error["type"], end.error["code"]) == ("service_unavailable_error", "replica_lost"), end
        assert_503_with_retry_after(plain_answer, "replica_lost")

        record_recovery(base, end, killed_at[0], figures)
    finally:
        serve.delete(app)


# -- what Serve's proxy does when the replica's process dies, and what the client then gets ------------


async def proxy_answer(serve_proxy) -> httpx.Response:
    """One request through the OpenAI-errors middleware around a stand-in for Serve's proxy."""
    transport = httpx.ASGITransport(app=OpenAIErrorsFromServe(serve_proxy))
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        return await client.post("/v1/completions", json={})


async def test_a_stream_that_a_dead_replica_left_open_ends_with_an_error_event_and_done():
    async def replica_dies_mid_stream(scope, receive, send):  # Serve's proxy stops without a last chunk
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})

    r = await proxy_answer(replica_dies_mid_stream)
    events = [frame[len("data: "):] for frame in r.text.split("\n\n") if frame]
    assert events[0] == '{"choices": []}' and events[-1] == "[DONE]"
    error = json.loads(events[1])["error"]
    assert (error["type"], error["code"]) == ("service_unavailable_error", "replica_lost")


async def test_a_request_whose_replica_died_before_answering_gets_503_with_retry_after():
    async def replica_dies_before_answering(scope, receive, send):  # Serve's proxy sends nothing for a 500
        return

    r = await proxy_answer(replica_dies_before_answering)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "replica_lost"


async def test_a_finished_stream_passes_the_proxy_untouched():
    body = b'data: {"choices": []}\n\ndata: [DONE]\n\n'

    async def replica_streams(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    assert (await proxy_answer(replica_streams)).content == body
