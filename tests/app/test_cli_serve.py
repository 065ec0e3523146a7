"""`shardserve serve` end to end: a real process, its own local Ray, loopback only, and its shutdown on SIGTERM:
idle it exits 0 at once, whoever sends the signal (its PID, or its whole process group, as systemd, `kill --
-PGID` and Ctrl-C do) and after a TP worker was lost and its replica replaced; with a stream in flight it
refuses new requests with 503, aborts the stream after --shutdown-timeout, and exits 0; either way no process
it started outlives it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from app.cli import _is_loopback
from engine.cpu_binding import format_core_list
from tests.app.conftest import free_port
from tests.app.test_serve_scaling import _listening_sockets_of_process_tree, _process_tree

# a dead process's children can take a moment to follow it after `ray.shutdown()` has signalled them
TREE_EXIT_WAIT_S = 10
# An idle server has nothing to wait for: 3-4.5 s measured on 2 cores (docs/OPERATIONS.md, "Stopping"). The
# bound is a guard against waiting out a timeout (--shutdown-timeout, Serve's own 20-30 s), not a speed claim.
IDLE_STOP_BOUND_S = 15


def start_server(model_dir: Path, port: int, log: Path, *flags: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}  # the CLI sets it
    command = [sys.executable, "-m", "app.cli", "serve", "--model", str(model_dir), "--port", str(port),
               "--served-model-name", "tiny", "--dtype", "float32", "--cpus-per-rank", "0.5", "--max-num-seqs", "8",
               *flags]
    with open(log, "w") as out:
        # a process group of its own (its PID is the group's id), so that a test can signal the whole group
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_until_healthy(server: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 180
    while True:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not become healthy:\n" + log.read_text()[-3000:]
        time.sleep(0.5)


def still_running(pids: list[int]) -> list[str]:
    """The command lines of those pids that still run (zombies waiting for their reaper do not count)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except OSError:
            continue
        if state != "Z":
            alive.append(f"{pid}: {cmdline}")
    return alive


def assert_every_process_exits(pids: list[int]) -> None:
    deadline = time.monotonic() + TREE_EXIT_WAIT_S
    while still_running(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not still_running(pids), still_running(pids)


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.kill()
        server.wait()


def test_ray_stays_on_loopback_unless_the_cluster_joined_is_on_another_host():
    assert all(map(_is_loopback, ["127.0.0.1:6379", "ray://localhost:10001", "[::1]:6379"]))
    assert not any(map(_is_loopback, ["10.0.0.5:6379", "ray-head.shardserve.svc:6379"]))


def complete(port: int) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0})


def signal_every_process(server: subprocess.Popen, sig: int) -> None:
    for pid in _process_tree(server.pid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


# how a stop arrives: to the CLI alone (`kill PID`), Ctrl-C in a terminal (SIGINT to the foreground process
# group), SIGTERM to the whole group (`kill -TERM -- -PGID`, supervisors), or to every process it started,
# whatever their groups (systemd's KillMode=control-group signals the whole cgroup)
DELIVERIES = {
    "sigterm-to-pid": lambda server: server.send_signal(signal.SIGTERM),
    "sigint-to-group": lambda server: os.killpg(server.pid, signal.SIGINT),
    "sigterm-to-group": lambda server: os.killpg(server.pid, signal.SIGTERM),
    "sigterm-to-every-process": lambda server: signal_every_process(server, signal.SIGTERM),
}


def stop_idle_server(server: subprocess.Popen, log: Path, deliver, what: str) -> None:
    """Signal the idle server as `deliver` does; it exits 0 well within the bound and leaves no process."""
    tree = _process_tree(server.pid)
    assert len(tree) >= 5, tree  # the CLI, GCS, raylet, Serve's controller and replica at least
    signalled = time.monotonic()
    deliver(server)
    assert server.wait(timeout=90) == 0, log.read_text()[-3000:]
    stopped_s = time.monotonic() - signalled
    print(f"idle stop ({what}): {stopped_s:.1f} s")
    assert stopped_s < IDLE_STOP_BOUND_S, log.read_text()[-3000:]
    assert_every_process_exits(tree)


def thread_cores(pid: int) -> dict[str, str]:
    """Each thread's name and the cores it may run on (Cpus_allowed_list), of process pid."""
    threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
        except OSError:  # a thread that ended meanwhile
            continue
        threads[f"{status['Name'].strip()}/{task.name}"] = status["Cpus_allowed_list"].strip()
    return threads


def assert_ray_runs_off_the_compute_core(tree: list[int], control: str, compute: str) -> None:
    """With --cpu-threads-bind leaving a core out, every thread of Ray's processes runs there, but the engine's
    step thread, which runs on the bound core (app/cpu_placement.py)."""
    titles = {pid: " ".join(still_running([pid])) for pid in tree}
    ray_processes = [pid for pid, title in titles.items() if "gcs_server" in title or "raylet" in title
                     or "ray::" in title]
    assert len(ray_processes) >= 4, titles  # the GCS, the raylet, Serve's controller and the replica at least
    for pid in ray_processes:
        cores = thread_cores(pid)
        if "ServeReplica" in titles[pid]:
            bound = [name for name, c in cores.items() if c == compute]
            assert len(bound) == 1, cores  # the engine's step thread, its OpenMP team of one
            del cores[bound[0]]
        assert set(cores.values()) == {control}, (titles[pid], cores)


@pytest.mark.slow
def test_serve_command_binds_loopback_and_its_cores_serves_and_stops_on_sigterm(tiny_llama_dir, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    *others, last = sorted(os.sched_getaffinity(0))
    control = format_core_list(others)  # on a 2-core machine: core 0 for Ray, 1 for the engine
    server = start_server(tiny_llama_dir, port, log, "--max-model-len", "256", "--cpu-threads-bind", str(last))
    try:
        wait_until_healthy(server, port, log)
        r = complete(port)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert f"Ray and Serve run on core(s) {control}; the engine's threads on {last}" in log.read_text()
        assert_ray_runs_off_the_compute_core(_process_tree(server.pid), control, str(last))
        sockets = _listening_sockets_of_process_tree(server.pid)
        assert any(p == port for _, _, p in sockets)
        assert {addr for _, addr, _ in sockets} == {"127.0.0.1"}, sockets
        assert f"binding HTTP to 127.0.0.1:{port} (this machine only)" in log.read_text()
        stop_idle_server(server, log, DELIVERIES["sigterm-to-pid"], "sigterm-to-pid")
    finally:
        stop(server)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)


@pytest.mark.slow
# SIGTERM to the group is in make stress only: SIGINT to the group (Ctrl-C) and SIGTERM to every process (systemd's
# control-group stop) between them cover what it does, and each case starts a server of its own (~60 s here).
@pytest.mark.parametrize("delivery", ["sigint-to-group", pytest.param("sigterm-to-group", marks=pytest.mark.stress),
                                      "sigterm-to-every-process"])
def test_an_idle_server_stops_at_once_whoever_else_the_signal_reaches(tiny_llama_dir, tmp_path, delivery):
    # Ray's own processes (GCS, raylet) are in groups of their own: were they in the CLI's, they would die
    # first, and the drain would wait on a cluster that is gone (60 s and more, 9 processes left). Where they
    # are signalled anyway, the CLI sees its cluster gone and stops without waiting on it.
    port = free_port()
    log = tmp_path / "serve.log"
    server = start_server(tiny_llama_dir, port, log, "--max-model-len", "256")
    try:
        wait_until_healthy(server, port, log)
        assert complete(port).status_code == 200
        stop_idle_server(server, log, DELIVERIES[delivery], delivery)
        if delivery != "sigterm-to-every-process":  # only the CLI heard it: the replica drained and reported
            assert "drained in" in log.read_text() and "did not report" not in log.read_text()
    finally:
        stop(server)


def tensor_parallel_worker(pids: list[int]) -> int:
    workers = [pid for pid in pids if "TensorParallelWorker" in " ".join(still_running([pid]))]
    assert len(workers) == 1, still_running(pids)
    return workers[0]


@pytest.mark.slow
def test_an_idle_server_stops_at_once_after_a_lost_tp_worker_was_replaced(tiny_llama_dir, tmp_path):
    # The lost replica never reports its drain: the CLI waits only for the replicas Serve still lists, not for
    # the whole --shutdown-timeout (30 s)
    port = free_port()
    log = tmp_path / "serve.log"
    server = start_server(tiny_llama_dir, port, log, "--max-model-len", "256", "--tensor-parallel-size", "2")
    try:
        wait_until_healthy(server, port, log)
        assert complete(port).status_code == 200
        lost = tensor_parallel_worker(_process_tree(server.pid))
        os.kill(lost, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:  # the replica's engine dies with its rank; Serve starts another with a new worker
            assert time.monotonic() < deadline, "the replica was not replaced:\n" + log.read_text()[-3000:]
            try:
                served = complete(port).status_code == 200
            except httpx.TransportError:
                served = False
            tree = _process_tree(server.pid)
            if served and lost not in tree and "TensorParallelWorker" in " ".join(still_running(tree)):
                break
            time.sleep(0.5)
        stop_idle_server(server, log, DELIVERIES["sigterm-to-pid"], "sigterm-to-pid after a lost TP worker")
        assert "did not report" not in log.read_text()
    finally:
        stop(server)


def data_events(lines: list[str]) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


@pytest.mark.slow
async def test_sigterm_refuses_new_requests_and_aborts_streams_still_running_at_the_shutdown_timeout(
        tiny_llama_dir, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    shutdown_timeout_s = 2.0
    # the torch reference kernels: slower steps, so the streams surely outlast the timeout
    server = start_server(tiny_llama_dir, port, log, "--max-model-len", "1024", "--kernel-backend", "torch",
                          "--shutdown-timeout", str(shutdown_timeout_s))
    try:
        await asyncio.to_thread(wait_until_healthy, server, port, log)
        tree = _process_tree(server.pid)
        long_body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True,
                     "stream": True}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            started = [asyncio.Event() for _ in range(8)]

            async def read_stream(started: asyncio.Event) -> list[str]:
                lines = []
                async with http.stream("POST", "/v1/completions", json=long_body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        lines.append(line)
                        started.set()
                return lines

            # eight streams of 1000 tokens on 2 shared cores with the torch kernels: well past the 2 s timeout
            # (four streams on the native kernels once finished in time on a quiet machine)
            streams = [asyncio.create_task(read_stream(s)) for s in started]
            await asyncio.gather(*(s.wait() for s in started))
            signalled = time.monotonic()
            server.send_signal(signal.SIGTERM)
            refused = None
            # until refused, or the server has gone. A probe sent before the replica heard of the drain is
            # admitted and waits behind the eight streams (every seat is taken) until the deadline aborts it,
            # so each probe waits half a second at most and the next one is sent: a refusal answers at once.
            while refused is None and server.poll() is None and time.monotonic() - signalled < 30:
                try:
                    r = await http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                                        timeout=0.5)
                except httpx.TimeoutException:
                    continue
                except httpx.TransportError:
                    break
                if r.status_code == 503:
                    refused = r
                else:  # sent before the replica heard of the drain
                    assert r.status_code == 200, r.text
                    await asyncio.sleep(0.1)
            results = await asyncio.gather(*streams)
        assert refused is not None, "no request was refused during the drain"
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "server_shutting_down"
        for lines in results:
            events = data_events(lines)
            assert events[-1] == "[DONE]"
            finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"]]
            assert finishes[-1] == "abort" and finishes.count("abort") == 1
        assert await asyncio.to_thread(server.wait, 90) == 0, log.read_text()[-3000:]
        stopped_s = time.monotonic() - signalled
        print(f"draining stop: {stopped_s:.1f} s after SIGTERM with --shutdown-timeout {shutdown_timeout_s}")
        assert stopped_s >= shutdown_timeout_s  # the streams had their time
        assert_every_process_exits(tree)
    finally:
        stop(server)
