"""The recovery figures of docs/OPERATIONS.md ("Failures and recovery"): `shardserve serve` as a user runs it
(the demo model at TP=1; the bench model at TP=2), each fault repeated mid-stream, timed from the kill to the
first request that succeeds through the same endpoint. A few minutes per case: `make stress` runs them and
prints the figures.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.reliability.chaos import (
    break_engine_steps,
    completion_body,
    descendants_titled,
    replica_actor,
    seconds_to_first_success,
    stream_cut_by,
)
from tests.serve_cluster import free_port

ROUNDS = 3
DEMO_MODEL_NAME = "shardserve-demo"
START_DEADLINE_S = 600
RECOVERY_DEADLINE_S = 300
REPLICA_TITLE = "ray::ServeReplica:shardserve:LLMServer"
TP_WORKER_TITLE = "ray::TensorParallelWorker"


@contextmanager
def shardserve(log: Path, *flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`shardserve serve` (demo model, its own local Ray) on a free port; yields the process and its URL."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}  # the CLI sets it
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port), *flags],
                                  stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy:\n" + log.read_text()[-3000:]
            time.sleep(0.5)
        yield server, base
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def one_process_titled(root_pid: int, title: str) -> int:
    """The one live process under root_pid with this title (a replaced one may linger while it stops)."""
    deadline = time.monotonic() + 60
    while True:
        pids = descendants_titled(root_pid, title)
        if len(pids) == 1:
            return pids[0]
        assert time.monotonic() < deadline, f"{len(pids)} processes titled {title!r}"
        time.sleep(0.2)


def kill_mid_stream_and_time_recovery(server: subprocess.Popen, base: str, title: str) -> tuple[float, float, str]:
    """SIGKILL the process titled `title` mid-stream: (stream end after the kill, first success after it, what
    the stream ended with)."""
    pid = one_process_titled(server.pid, title)
    killed_at: list[float] = []

    def kill() -> None:
        os.kill(pid, signal.SIGKILL)
        killed_at.append(time.monotonic())

    end = stream_cut_by(f"{base}/v1/completions", completion_body(DEMO_MODEL_NAME, 400, stream=True), kill)
    assert end.finish_reasons == [] and (end.error is not None or end.transport_error is not None), end
    assert "Timeout" not in (end.transport_error or ""), end
    seconds, _ = seconds_to_first_success(f"{base}/v1/completions", completion_body(DEMO_MODEL_NAME, 4),
                                          killed_at[0], RECOVERY_DEADLINE_S)
    seen = f"error event {end.error['code']!r}" if end.error is not None else end.transport_error
    return end.seconds_after_fault, seconds, seen


def fail_steps_mid_stream_and_time_recovery(base: str, app: str) -> tuple[float, float, str]:
    """Make the replica's engine steps raise mid-stream: (stream end after it, first success after it, seen)."""
    replica = replica_actor(app, deadline_s=60)  # the replaced one may still be stopping
    failed_at: list[float] = []

    def fail_steps() -> None:
        failed_at.append(time.monotonic())
        break_engine_steps(replica)

    end = stream_cut_by(f"{base}/v1/completions", completion_body(DEMO_MODEL_NAME, 400, stream=True), fail_steps)
    assert end.error["code"] == "engine_dead" and end.events[-1] == "[DONE]", end
    seconds, _ = seconds_to_first_success(f"{base}/v1/completions", completion_body(DEMO_MODEL_NAME, 4),
                                          failed_at[0], RECOVERY_DEADLINE_S)
    return end.seconds_after_fault, seconds, "error event 'engine_dead'"


def report(figures: list[str], fault: str, results: list[tuple[float, float, str]]) -> None:
    recoveries = [r for _, r, _ in results]
    figures.append(f"{fault}: client saw {sorted({s for _, _, s in results})}, stream ended within "
                   f"{max(e for e, _, _ in results):.2f} s; fault -> first success: median "
                   f"{statistics.median(recoveries):.1f} s, min {min(recoveries):.1f} s, max {max(recoveries):.1f} s "
                   f"({len(results)} rounds: {', '.join(f'{r:.1f}' for r in recoveries)})")


def bench_model_flags() -> list[str]:
    """The demo model has 9 attention heads, which 2 ranks cannot split: TP=2 runs the bench model."""
    from engine.checkpoint.random_model import ensure_bench_model

    return ["--model", str(ensure_bench_model()), "--served-model-name", DEMO_MODEL_NAME]


@pytest.mark.stress
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(("fault", "tensor_parallel_size", "title"), [
    ("replica process SIGKILL, demo model, TP=1", 1, REPLICA_TITLE),
    ("TP worker SIGKILL, bench model, TP=2", 2, TP_WORKER_TITLE),
])
def test_recovery_after_a_kill_mid_stream(tmp_path, figures, fault, tensor_parallel_size, title):
    flags = ["--tensor-parallel-size", str(tensor_parallel_size)]
    if tensor_parallel_size > 1:
        flags += bench_model_flags()
    with shardserve(tmp_path / "serve.log", *flags) as (server, base):
        results = [kill_mid_stream_and_time_recovery(server, base, title) for _ in range(ROUNDS)]
    report(figures, fault, results)


@pytest.mark.stress
@pytest.mark.timeout(1800)
def test_recovery_after_an_exception_in_an_engine_step(serve_cluster, figures):
    """The demo model at TP=1 on the test cluster: the fault is injected into the replica's engine."""
    from ray import serve

    from app.config import ServeArgs
    from app.deployment import build_app

    app = "chaos-step"
    serve.run(build_app(ServeArgs(num_replicas=1)), name=app, route_prefix=f"/{app}")
    base = serve_cluster.url(f"/{app}")
    try:
        results = [fail_steps_mid_stream_and_time_recovery(base, app) for _ in range(ROUNDS)]
    finally:
        serve.delete(app)
    report(figures, "exception in an engine step, demo model, TP=1", results)
