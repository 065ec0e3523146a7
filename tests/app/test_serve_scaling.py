"""Autoscaling on engine queue depth, loopback-only Ray, and health under load, on local Ray Serve."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
import pytest

from tests.app.conftest import API_KEY, SERVED_NAME, tiny_serve_args


def running_replicas(app_name: str, deployment: str = "LLMServer") -> int:
    """Running replicas of the application's engine deployment (not its ingress)."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None or deployment not in app.deployments:
        return 0
    return app.deployments[deployment].replica_states.get("RUNNING", 0)


async def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.2)


@pytest.mark.slow
async def test_replicas_follow_engine_queue_depth_up_and_back_down(serve_cluster, tiny_llama_dir):
    """1 replica -> 2 under queued load -> 1 when idle. Bounds: upscale delay 0.5 s, downscale delay 2 s,
    metrics every 0.5 s over a 2 s window; the waits below allow for replica start-up (10-20 s, up to a minute or
    two while `make test`'s other process runs tests beside this one) on 2 busy cores."""
    from ray import serve

    from app.deployment import build_app

    args = tiny_serve_args(tiny_llama_dir, num_replicas=None, min_replicas=1, max_replicas=2,
                           target_queue_depth=2, upscale_delay_s=0.5, downscale_delay_s=2.0, max_num_seqs=2,
                           api_key=None)
    serve.run(build_app(args), name="autoscale", route_prefix="/autoscale")
    try:
        assert running_replicas("autoscale") == 1
        # short requests, sent again and again: the queue stays deep while the load lasts, and little is left
        # to finish once it stops
        body = {"model": SERVED_NAME, "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True,
                "temperature": 0, "stream": True}

        async def keep_busy(http: httpx.AsyncClient) -> None:
            while True:  # until cancelled: the queue stays deep however long the second replica takes
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    async for _ in response.aiter_lines():
                        pass

        async with httpx.AsyncClient(base_url=serve_cluster.url("/autoscale"), timeout=300) as http:
            started = time.monotonic()
            load = [asyncio.create_task(keep_busy(http)) for _ in range(10)]
            try:
                await wait_for(lambda: running_replicas("autoscale") == 2, 180, "a second replica under load")
                print(f"up to 2 replicas {time.monotonic() - started:.0f} s after the load began")
                # with several replicas possible, the ingress's request router (app/routing/) reads each one's load;
                # the handle asks either replica, and the short requests leave one idle for a moment now and then
                server = serve.get_deployment_handle("LLMServer", "autoscale")
                reports = [await server.record_routing_stats.remote() for _ in range(20)]
                assert any(r["queue_depth"] >= 1 and 0 < r["kv_cache_usage"] <= 1 for r in reports), reports
            finally:
                for task in load:
                    task.cancel()
                await asyncio.gather(*load, return_exceptions=True)
            await wait_for(lambda: running_replicas("autoscale") == 1, 120, "scale-down to one idle replica")
            print(f"back to 1 replica {time.monotonic() - started:.0f} s after it began")
            ok = await http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200
    finally:
        serve.delete("autoscale")


async def test_health_answers_while_the_engine_is_busy(served_tiny):
    cluster, handle = served_tiny
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": SERVED_NAME, "prompt": "In the beginning", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(base_url=cluster.url(), headers=headers, timeout=120) as http:
        async def stream_until_health_checked(started: asyncio.Event, checked: asyncio.Event) -> None:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for _ in response.aiter_lines():
                    started.set()
                    if checked.is_set():
                        return

        checked = asyncio.Event()
        starts = [asyncio.Event() for _ in range(8)]
        load = [asyncio.create_task(stream_until_health_checked(s, checked)) for s in starts]
        await asyncio.gather(*(s.wait() for s in starts))
        assert (await handle.engine_stats.remote())["num_running"] == 8
        health = await http.get("/health")
        checked.set()
        await asyncio.gather(*load)
    assert health.status_code == 200


def _process_tree(root_pid: int) -> list[int]:
    """root_pid and every process descended from it, read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    pids, stack = [], [root_pid]
    while stack:
        pid = stack.pop()
        pids.append(pid)
        stack.extend(children.get(pid, []))
    return pids


def _listening_sockets_of_process_tree(root_pid: int) -> list[tuple[int, str, int]]:
    """(pid, local address, port) of every listening TCP socket of root_pid and its descendants."""
    pids = _process_tree(root_pid)
    inode_pid = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inode_pid[target[8:-1]] = pid
        except OSError:
            continue
    sockets = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state != "0A" or inode not in inode_pid:  # 0A = LISTEN
                continue
            host_hex, port_hex = local.split(":")
            sockets.append((inode_pid[inode], _decode_address(host_hex, width), int(port_hex, 16)))
    return sockets


def _decode_address(host_hex: str, width: int) -> str:
    raw = bytes.fromhex(host_hex)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # /proc stores 32-bit words host-order
    if width == 8:
        return ".".join(str(b) for b in words)
    if words[:12] == b"\0" * 10 + b"\xff\xff":
        return ".".join(str(b) for b in words[12:])
    return ":".join(words[i:i + 2].hex() for i in range(0, 16, 2))


def test_every_ray_and_serve_port_listens_on_loopback_only(served_tiny):
    sockets = _listening_sockets_of_process_tree(os.getpid())
    assert len(sockets) >= 5, sockets  # GCS, raylet, object manager, workers, Serve's proxy at least
    assert {addr for _, addr, _ in sockets} <= {"127.0.0.1", "0000:0000:0000:0000:0000:0000:0000:0001"}, sockets
