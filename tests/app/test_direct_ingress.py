"""`--http-ingress`: which process answers HTTP on --port, and that direct ingress keeps what the proxy path does.

The rules are unit-tested; the served cases run a real `shardserve serve` (its own local Ray, loopback only) in
each mode and check, on the one port clients use: who listens there (the LLMServer replica's process, or Serve's
proxy actor), a stream through the openai client, the end of a stream whose client left (the engine request is
aborted), Serve's own 429 in OpenAI's shape (the proxy middleware runs in the replica's server too), the API key
and /metrics. Draining on SIGTERM runs through the default (direct) in tests/app/test_cli_serve.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from app.config import ServeArgs
from app.direct_ingress import direct_ingress_env, resolve_http_ingress, single_ingress_replica_reason
from tests.app.conftest import free_port
from tests.app.test_cli_serve import start_server, stop, wait_until_healthy
from tests.app.test_serve_scaling import _listening_sockets_of_process_tree, _process_tree

API_KEY = "sk-direct"


@pytest.mark.parametrize("settings, own_cluster, expected", [
    ({}, True, "direct"),  # the defaults: one LLMServer replica
    ({}, False, "proxy"),  # a joined cluster's Serve was started without the settings
    ({"http_ingress": "proxy"}, True, "proxy"),
    ({"http_ingress": "direct"}, False, "direct"),  # asked for: the operator exported them at `ray start`
    ({"max_replicas": 3}, True, "direct"),  # the prefix router's one OpenAIIngress replica
    ({"max_replicas": 3, "ingress_replicas": 2}, True, "proxy"),
    ({"max_replicas": 3, "routing": "serve-default"}, True, "proxy"),
    ({"num_replicas": 2, "routing": "serve-default"}, True, "proxy"),
    ({"min_replicas": 0}, True, "proxy"),  # scaled to zero, nothing would listen
    ({"num_replicas": 1, "min_replicas": 0}, True, "direct"),  # a fixed count overrides autoscaling
])
def test_auto_is_direct_only_where_one_ingress_replica_holds_the_port(settings, own_cluster, expected):
    assert resolve_http_ingress(ServeArgs(**settings), own_cluster) == expected


@pytest.mark.parametrize("settings, reason", [
    ({"max_replicas": 3, "ingress_replicas": 2}, "--ingress-replicas is 2"),
    ({"min_replicas": 0}, "--min-replicas 0"),
    ({"num_replicas": 2, "routing": "serve-default"}, "serve-default"),
])
def test_direct_is_refused_with_the_reason_where_it_cannot_hold(settings, reason):
    args = ServeArgs(http_ingress="direct", **settings)
    assert reason in single_ingress_replica_reason(args)
    with pytest.raises(ValueError, match="--http-ingress direct needs exactly one ingress replica") as e:
        resolve_http_ingress(args, own_cluster=True)
    assert reason in str(e.value)


def test_the_port_range_is_the_port_alone():
    env = direct_ingress_env(8123)
    # Serve's allocator takes range(min, max): 8123 and nothing else
    assert list(range(int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]),
                      int(env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]))) == [8123]
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"


def test_the_controller_callback_places_no_proxy_on_any_node():
    # in a process of its own, as in Serve's controller: the patch is to Serve's class
    code = ("from app.direct_ingress import no_head_proxy\n"
            "from ray.serve._private.proxy_state import ProxyStateManager\n"
            "no_head_proxy()\n"
            "no_head_proxy()  # a second call changes nothing\n"
            "print(ProxyStateManager._get_target_nodes(None, {'head-node-id'}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def _listener_command(server_pid: int, port: int) -> str:
    """The command line (Ray's process title) of the process that listens on `port`."""
    pids = [pid for pid, _, p in _listening_sockets_of_process_tree(server_pid) if p == port]
    assert len(pids) == 1, _listening_sockets_of_process_tree(server_pid)
    return _command(pids[0])


async def _engine_idle(http: httpx.AsyncClient, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        r = await http.get("/v1/engine/stats")  # a request like any other: Serve's queue may be full (429)
        stats = r.json() if r.status_code == 200 else None
        if stats is not None and stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("mode, listener", [("direct", "ServeReplica:shardserve:LLMServer"), ("proxy", "ProxyActor")])
async def test_what_answers_the_port_and_what_it_keeps(tiny_llama_dir, tmp_path, mode, listener):
    port = free_port()
    log = tmp_path / "serve.log"
    # one request at a time in the engine, one more in Serve's queue: a third is Serve's own 429
    server = start_server(tiny_llama_dir, port, log, "--http-ingress", mode, "--max-model-len", "1024",
                          "--kernel-backend", "torch", "--max-ongoing-requests", "1", "--max-waiting-requests", "1",
                          "--api-key", API_KEY)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        await asyncio.to_thread(wait_until_healthy, server, port, log)
        assert listener in _listener_command(server.pid, port)
        # direct ingress keeps no idle proxy beside the replica (app.direct_ingress.no_head_proxy)
        proxies = [pid for pid in _process_tree(server.pid) if "ProxyActor" in _command(pid)]
        assert bool(proxies) == (mode == "proxy"), proxies

        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)
        stream = await client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6,
                                                 stream=True)
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].choices[0].finish_reason == "length"
        assert sum(1 for c in chunks for _ in c.choices) == 6

        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong",
                                     max_retries=0).models.list()

        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60) as http:
            assert "shardserve:" in (await http.get("/metrics")).text
            long_body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True,
                         "stream": True}

            # a client that leaves mid-stream: its engine request ends, long before its 1000 tokens
            async with http.stream("POST", "/v1/completions", json=long_body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break
            left = time.monotonic()
            await _engine_idle(http)
            print(f"{mode}: the engine was idle {time.monotonic() - left:.2f} s after the client left")

            # one stream runs (A), and two more come (B, a long stream, and P, a short request): the queue has
            # one seat, so whichever of B and P comes second is Serve's own 429, answered at once in OpenAI's
            # shape, while the other waits behind A
            async def answer(body: dict, streaming: asyncio.Event | None = None) -> httpx.Response:
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code == 200:
                        async for line in response.aiter_lines():
                            if streaming is not None and line.startswith("data: "):
                                streaming.set()
                    else:
                        await response.aread()
                    return response

            streaming = asyncio.Event()
            running = asyncio.create_task(answer(long_body, streaming))
            await asyncio.wait_for(streaming.wait(), 60)  # A holds the engine's one seat
            waiting = [asyncio.create_task(answer(body)) for body in
                       (long_body, {"model": "tiny", "prompt": "Hi", "max_tokens": 2})]
            done, _ = await asyncio.wait(waiting, timeout=60, return_when=asyncio.FIRST_COMPLETED)
            assert done and not running.done(), "neither B nor P was answered while A ran"
            r = done.pop().result()
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "1" and r.headers["content-type"] == "application/json"
            error = r.json()["error"]
            assert error["type"] == "rate_limit_error" and "backpressure" in error["message"], error  # Serve's
            for task in (running, *waiting):
                task.cancel()
            await asyncio.gather(running, *waiting, return_exceptions=True)
            await _engine_idle(http)
    finally:
        stop(server)


def _pid_of(title: str, server_pid: int) -> int:
    pids = [pid for pid in _process_tree(server_pid) if title in _command(pid)]
    assert len(pids) == 1, pids
    return pids[0]


def _command(pid: int) -> str:
    """The command line (Ray's process title) of `pid`; empty where it exited meanwhile."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.slow
async def test_a_replica_killed_mid_stream_is_replaced_on_the_same_port(tiny_llama_dir, tmp_path):
    """Direct ingress: the replica's process dies (SIGKILL) with a stream open. The client's connection drops (the
    server died with it), and the replacement listens on the same port again: its socket reuses the address that
    the dead one's connections still hold in TIME_WAIT, where Serve's own bind would fail for a minute."""
    port = free_port()
    log = tmp_path / "serve.log"
    server = start_server(tiny_llama_dir, port, log, "--max-model-len", "1024", "--kernel-backend", "torch")
    try:
        await asyncio.to_thread(wait_until_healthy, server, port, log)
        replica = _pid_of("ServeReplica:shardserve:LLMServer", server.pid)
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            with pytest.raises(httpx.TransportError):
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            os.kill(replica, signal.SIGKILL)
                            killed = time.monotonic()
            deadline = killed + 90
            while True:
                assert server.poll() is None, log.read_text()[-3000:]
                try:
                    r = await http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                                        timeout=5)
                    if r.status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "no answer on the port 90 s after the kill:\n" + \
                    log.read_text()[-3000:]
                await asyncio.sleep(0.2)
        print(f"direct ingress: first 200 {time.monotonic() - killed:.1f} s after the replica was killed mid-stream")
        assert _pid_of("ServeReplica:shardserve:LLMServer", server.pid) != replica
        # the replacement bound the port at its first try (Serve logs each failed bind, then blocks the port)
        assert "Failed to bind to address" not in log.read_text()
    finally:
        stop(server)
