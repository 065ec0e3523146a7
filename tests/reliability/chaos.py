"""What the chaos tests share: finding a process of our own cluster to kill, reading a stream to its end,
and timing recovery (from the kill to the first request that succeeds through the same endpoint)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.app.test_serve_scaling import _process_tree

# a probe that waits this long for an answer is a hang, not a slow answer
PROBE_TIMEOUT_S = 30.0
PROBE_INTERVAL_S = 0.1


# -- processes ----------------------------------------------------------------------------------------


def alive_actors() -> list[dict]:
    """Every live actor of the connected Ray cluster: class, name, pid and addresses, from the GCS's table
    (ray.util.state would need the dashboard, which the tests do not start)."""
    from ray._private import state

    return [actor for actor in state.actors().values() if actor["State"] == "ALIVE"]


def replica_actor(app: str, deadline_s: float = 0.0) -> dict:
    """The one live replica of a Serve application (Serve names it SERVE_REPLICA::<app>#<deployment>#<id>);
    waits up to deadline_s for a replaced one to be gone."""
    deadline = time.monotonic() + deadline_s
    while True:
        replicas = [a for a in alive_actors() if a["Name"].startswith(f"SERVE_REPLICA::{app}#")]
        if len(replicas) == 1 or time.monotonic() >= deadline:
            assert len(replicas) == 1, replicas
            return replicas[0]
        time.sleep(PROBE_INTERVAL_S)


def death_cause_of(actor_id: str, deadline_s: float) -> str:
    """Wait (up to deadline_s) for the actor to be dead; Ray's account of why, as text (a worker process that
    exited by itself reads WORKER_DIED, one that Serve's controller removed reads RAY_KILL)."""
    from ray._private import state

    deadline = time.monotonic() + deadline_s
    while True:
        actor = state.actors().get(actor_id)
        if actor is not None and actor["State"] == "DEAD":
            return str(actor["DeathCause"])
        assert time.monotonic() < deadline, f"actor {actor_id} is still {actor and actor['State']}"
        time.sleep(PROBE_INTERVAL_S)


def break_engine_steps(replica: dict) -> None:
    """From now on every step of this replica's engine raises, as a device error would (test-only: the
    function runs inside the replica's process through Ray's `__ray_call__`, and reaches the LLMServer
    through Serve's private wrapper attributes)."""
    import ray

    def break_steps(serve_replica) -> None:
        server = serve_replica._replica_impl._user_callable_wrapper._callable

        def failing_step():
            raise RuntimeError("injected step failure")

        server.engine.engine.step = failing_step

    ray.get(ray.get_actor(replica["Name"], namespace="serve").__ray_call__.remote(break_steps))


def tp_worker_actors(replica: dict) -> list[dict]:
    """The tensor-parallel workers a replica started: their owner is the replica's worker process."""
    port = replica["Address"]["Port"]
    return [a for a in alive_actors()
            if a["ActorClassName"] == "TensorParallelWorker" and a["OwnerAddress"]["Port"] == port]


def descendants_titled(root_pid: int, title_prefix: str) -> list[int]:
    """Pids under root_pid whose command line (a Ray worker's process title) starts with title_prefix."""
    found = []
    for pid in _process_tree(root_pid)[1:]:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if title.startswith(title_prefix):
            found.append(pid)
    return found


# -- requests -----------------------------------------------------------------------------------------


def completion_body(model: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


@dataclass
class StreamEnd:
    """How a stream that was cut by a fault ended, as the client saw it."""

    events: list[str] = field(default_factory=list)  # each event's data, [DONE] included
    transport_error: str | None = None  # the connection broke instead of ending
    seconds_after_fault: float | None = None  # from the fault to the end of the stream

    @property
    def error(self) -> dict | None:
        """The in-band error event's `error` object, if the stream sent one."""
        for data in self.events:
            if data != "[DONE]" and "error" in (body := json.loads(data)):
                return body["error"]
        return None

    @property
    def finish_reasons(self) -> list[str]:
        return [choice["finish_reason"] for data in self.events if data != "[DONE]"
                for choice in json.loads(data).get("choices", []) if choice.get("finish_reason")]


def stream_cut_by(url: str, body: dict, fault: Callable[[], None], headers: dict | None = None,
                  read_timeout_s: float = PROBE_TIMEOUT_S) -> StreamEnd:
    """Open a stream, apply `fault` once its first event has arrived, and read it to its end (or its break)."""
    end = StreamEnd()
    fault_at = None
    timeout = httpx.Timeout(read_timeout_s, connect=10.0)
    try:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=timeout) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                end.events.append(line[len("data: "):])
                if fault_at is None:
                    fault()
                    fault_at = time.monotonic()
    except httpx.TransportError as e:  # a read timeout (a hang) is a TransportError too: the caller tells
        end.transport_error = f"{type(e).__name__}: {e}"
    assert fault_at is not None, f"the stream ended before its first event: {end}"
    end.seconds_after_fault = time.monotonic() - fault_at
    return end


def wait_until_running(base_url: str, num_running: int, deadline_s: float = PROBE_TIMEOUT_S) -> None:
    """Poll the replica's engine stats until `num_running` sequences are running (requests in flight)."""
    deadline = time.monotonic() + deadline_s
    while httpx.get(f"{base_url}/v1/engine/stats", timeout=PROBE_TIMEOUT_S).json()["num_running"] < num_running:
        assert time.monotonic() < deadline, f"fewer than {num_running} requests running after {deadline_s} s"
        time.sleep(PROBE_INTERVAL_S)


def seconds_to_first_success(url: str, body: dict, since: float, deadline_s: float,
                             headers: dict | None = None) -> tuple[float, list[str]]:
    """Send `body` until one answer is 200; returns (seconds from `since`, the answers before it).

    `since` is a time.monotonic() reading (the fault). Each probe waits at most PROBE_TIMEOUT_S."""
    seen: list[str] = []
    while True:
        try:
            r = httpx.post(url, json=body, headers=headers, timeout=PROBE_TIMEOUT_S)
            if r.status_code == 200:
                return time.monotonic() - since, seen
            seen.append(f"{r.status_code} {r.text[:200]}")
        except httpx.TransportError as e:
            seen.append(type(e).__name__)
        assert time.monotonic() - since < deadline_s, f"no success within {deadline_s} s: {_summary(seen)}"
        time.sleep(PROBE_INTERVAL_S)


def _summary(answers: list[str]) -> str:
    """Consecutive equal answers folded: ['503 ...' x 12, 'ReadTimeout' x 1, ...]."""
    folded: list[list] = []
    for answer in answers:
        if folded and folded[-1][0] == answer:
            folded[-1][1] += 1
        else:
            folded.append([answer, 1])
    return ", ".join(f"{a!r} x {n}" for a, n in folded)
