"""Graceful shutdown of `shardserve serve`: stop admitting, let in-flight requests finish, abort the rest.

Ray Serve cannot do this by itself. Its replica drain waits for ongoing requests before it tells user
code anything (`__del__` runs after them), and `serve.shutdown()` kills the HTTP proxy at once, which
cuts every open stream. So the CLI drains the application before it shuts Serve down:

- a `DrainBoard` in the GCS's key-value store (Ray's internal KV, which every Ray process reaches already) holds
  the drain: the CLI opens it before the replicas start, and writes the drain's timeout (`--shutdown-timeout`)
  on the signal. It has no process of its own: a named actor did this until 2026-12-05, and its process woke
  ~150 times a second on the cores the engine computes on (docs/BENCHMARKS.md, "Serving path: one event loop in
  the replica, no idle proxy");
- each replica's `ReplicaDrain` thread looks for the drain every DRAIN_POLL_S; once it begins, the
  replica's `DrainGate` answers new requests 503 with Retry-After, in-flight requests run on until the
  deadline, the engine then aborts the rest (their streams end with finish_reason "abort" and
  `[DONE]`), and the replica reports on the board that it has drained;
- the CLI waits for every live replica's report (or the deadline plus `ABORT_GRACE_S`), then shuts Serve
  and Ray down. Live means Serve still lists it: a replica that died (its engine, a TP worker, its node) never
  reports, and is not waited for. Every call to the cluster is bounded: a cluster that stopped answering (its
  processes were signalled too) ends the wait at once.

Without the CLI (`serve run configs/serve.yaml`) the board is not open, replicas skip all of this and Serve's
own drain applies (`graceful_shutdown_timeout_s`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import RETRY_AFTER_S, error_response

logger = logging.getLogger("shardserve.drain")

NAMESPACE = "shardserve"
# after the deadline, how long aborted requests get to write their last chunk before the replica stops waiting
ABORT_GRACE_S = 5.0
POLL_S = 0.05
# the longest the CLI waits on one call to the GCS or Serve's controller before taking the cluster for gone
CLUSTER_CALL_TIMEOUT_S = 5.0
# how often the drain asks Serve's controller which replicas it still lists
LIVE_REPLICAS_PERIOD_S = 1.0
# how often a replica looks for the drain on the board: a replica turns new requests away up to this much after the
# signal, and each look is one small GCS call (a few wake-ups, against the ~150 a second of an actor's process)
DRAIN_POLL_S = 0.25

T = TypeVar("T")


class ClusterGone(Exception):
    """The Ray cluster stopped answering during the drain (its own processes were signalled too, or died)."""


@dataclass
class DrainState:
    """One replica's side of a drain: whether it still admits requests, and how many HTTP requests are open."""

    draining: bool = False
    in_flight: int = 0


class DrainGate:
    """ASGI middleware: counts open requests; once draining, answers new /v1 requests 503 + Retry-After."""

    def __init__(self, app: ASGIApp, state: DrainState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.state.draining and scope["path"].startswith("/v1/"):
            response = error_response(503, "The server is shutting down and takes no new requests; retry on "
                                      "another server or later.", "service_unavailable_error",
                                      code="server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})
            await response(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


def finish_in_flight(state: DrainState, abort_all: Callable[[], None], timeout_s: float) -> int:
    """Drain one replica: refuse new requests, wait up to timeout_s for open ones, then abort what is left.

    Returns how many requests were still open at the deadline (0: everything finished in time)."""
    state.draining = True
    deadline = time.monotonic() + timeout_s
    while state.in_flight and time.monotonic() < deadline:
        time.sleep(POLL_S)
    left = state.in_flight
    if left:
        logger.info("drain: aborting %d request(s) still open after %.1f s", left, timeout_s)
        give_up = time.monotonic() + ABORT_GRACE_S
        while state.in_flight and time.monotonic() < give_up:
            abort_all()  # again each round: a request admitted just before the drain may reach the engine late
            time.sleep(4 * POLL_S)
    return left


class KeyValueStore(Protocol):
    """What the drain board needs of a key-value store (the GCS's: `GcsKeyValue`)."""

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes, overwrite: bool = True) -> None: ...

    def delete(self, key: str, by_prefix: bool = False) -> None: ...

    def keys(self, prefix: str) -> list[str]: ...


class GcsKeyValue:
    """Ray's internal key-value store in the GCS, in shardserve's namespace, from any process of the cluster (the
    CLI's driver, a replica); each call gives up after CLUSTER_CALL_TIMEOUT_S (ray.exceptions.RpcError)."""

    def __init__(self, timeout_s: float = CLUSTER_CALL_TIMEOUT_S):
        from ray.experimental.internal_kv import internal_kv_get_gcs_client

        self.gcs = internal_kv_get_gcs_client()
        self.timeout_s = timeout_s
        self.namespace = NAMESPACE.encode()

    def get(self, key: str) -> bytes | None:
        return self.gcs.internal_kv_get(key.encode(), namespace=self.namespace, timeout=self.timeout_s)

    def put(self, key: str, value: bytes, overwrite: bool = True) -> None:
        self.gcs.internal_kv_put(key.encode(), value, overwrite, namespace=self.namespace, timeout=self.timeout_s)

    def delete(self, key: str, by_prefix: bool = False) -> None:
        self.gcs.internal_kv_del(key.encode(), by_prefix, namespace=self.namespace, timeout=self.timeout_s)

    def keys(self, prefix: str) -> list[str]:
        return [key.decode() for key in
                self.gcs.internal_kv_keys(prefix.encode(), namespace=self.namespace, timeout=self.timeout_s)]


class DrainBoard:
    """One application's drain, as keys under `drain/<app>/` of a key-value store that the CLI and the replicas
    share:
    - `cli`: a CLI serves this application and drains it on a signal (without it replicas leave the drain to Serve);
    - `timeout`: the drain has begun, with this many seconds for the open requests (each replica counts them from
      when it sees the key, at most DRAIN_POLL_S after the CLI wrote it; no clocks are shared across hosts);
    - `open/<replica id>`: the replica waits for the drain; `drained/<replica id>`: it has drained. Both go when
      Serve stops the replica (scaled down, replaced)."""

    def __init__(self, app_name: str, store: KeyValueStore):
        self.prefix = f"drain/{app_name}/"
        self.store = store

    def open(self) -> None:
        """The CLI, before the replicas start: a fresh board (an earlier CLI's on a cluster it joined goes)."""
        self.close()
        self.store.put(self.prefix + "cli", b"1")

    def close(self) -> None:
        self.store.delete(self.prefix, by_prefix=True)

    def is_open(self) -> bool:
        return self.store.get(self.prefix + "cli") is not None

    def register(self, replica_id: str) -> None:
        self.store.put(f"{self.prefix}open/{replica_id}", b"1")

    def unregister(self, replica_id: str) -> None:
        """A replica that Serve stopped (scaled down, replaced) has nothing left to drain."""
        self.store.delete(f"{self.prefix}open/{replica_id}")
        self.store.delete(f"{self.prefix}drained/{replica_id}")

    def begin(self, timeout_s: float) -> None:
        """The drain begins (a second begin keeps the first timeout)."""
        self.store.put(self.prefix + "timeout", repr(float(timeout_s)).encode(), overwrite=False)

    def began(self) -> float | None:
        """The drain's timeout once it has begun, else None."""
        value = self.store.get(self.prefix + "timeout")
        return None if value is None else float(value)

    def report_drained(self, replica_id: str) -> None:
        self.store.put(f"{self.prefix}drained/{replica_id}", b"1")

    def pending(self, live: list[str] | None = None) -> list[str]:
        """Replicas that have not drained yet, of those still `live` (all registered ones if None)."""
        registered = {key.rsplit("/", 1)[1] for key in self.store.keys(self.prefix + "open/")}
        drained = {key.rsplit("/", 1)[1] for key in self.store.keys(self.prefix + "drained/")}
        replicas = registered if live is None else registered & set(live)
        return sorted(replicas - drained)


def open_board(app_name: str) -> DrainBoard:
    """The application's drain board, opened (the CLI does, before `serve.run`)."""
    board = DrainBoard(app_name, GcsKeyValue())
    board.open()
    return board


def bounded(call: Callable[[], T], cluster_alive: Callable[[], bool], timeout_s: float = CLUSTER_CALL_TIMEOUT_S) -> T:
    """`call()` (calls to the GCS or Serve's controller) on a thread of its own, given up at once where the cluster's
    processes exit and after `timeout_s` in any case: a Ray call into a GCS that is going away can block for a minute
    (Ray's client waits 60 s for the GCS to come back, then ends the process), and the CLI must not wait for it."""
    import ray

    outcome: list = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as error:  # noqa: BLE001 - raised again on the caller's thread
            outcome.append((False, error))
        done.set()

    threading.Thread(target=run, name="shardserve-drain-call", daemon=True).start()
    give_up = time.monotonic() + timeout_s
    while not done.wait(POLL_S):
        if not cluster_alive():
            raise ray.exceptions.RaySystemError("the cluster's own processes have exited")
        if time.monotonic() > give_up:
            raise ray.exceptions.GetTimeoutError(f"no answer within {timeout_s:.0f} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def live_replicas(app_name: str) -> list[str]:
    """The ids of the application's replicas that Serve's controller still lists (starting, running, stopping).
    Unbounded: the drain calls it through `bounded`."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    details = ray.get(controller.get_serve_instance_details.remote())
    app = (details.get("applications") or {}).get(app_name) or {}
    return [replica["replica_id"] for deployment in app.get("deployments", {}).values()
            for replica in deployment.get("replicas", [])]


def drain_application(board: DrainBoard, app_name: str, timeout_s: float, hurry: threading.Event,
                      cluster_alive: Callable[[], bool]) -> list[str]:
    """Begin the drain and wait until every live replica has drained, or the deadline plus ABORT_GRACE_S, or
    until `hurry` is set (a second Ctrl-C). Returns the replicas that had not drained; raises ClusterGone when
    the cluster is (`cluster_alive()` False, or a call unanswered)."""
    import ray

    give_up = time.monotonic() + timeout_s + ABORT_GRACE_S + 1.0
    try:
        bounded(lambda: board.begin(timeout_s), cluster_alive)
        listed_at = -LIVE_REPLICAS_PERIOD_S
        while True:
            if time.monotonic() - listed_at >= LIVE_REPLICAS_PERIOD_S:  # the controller's details are not cheap
                # ray.get_actor asks the GCS, with no timeout of its own
                live, listed_at = bounded(lambda: live_replicas(app_name), cluster_alive), time.monotonic()
            pending = bounded(lambda: board.pending(live), cluster_alive)  # noqa: B023 - called at once
            if not pending or time.monotonic() > give_up or hurry.wait(POLL_S):
                return pending
    except (ray.exceptions.RayError, ValueError) as gone:  # a timeout is a RayError; ValueError: no such actor
        raise ClusterGone(str(gone).splitlines()[0]) from gone


class ReplicaDrain:
    """A replica's part in the CLI's drain: a thread that looks for it on the board, then runs it."""

    def __init__(self, board: DrainBoard, replica_id: str, state: DrainState, abort_all: Callable[[], None],
                 poll_s: float = DRAIN_POLL_S):
        self.board = board
        self.replica_id = replica_id
        self.state = state
        self.abort_all = abort_all
        self.poll_s = poll_s
        self.detached = threading.Event()
        self.thread = threading.Thread(target=self._run, name="shardserve-drain", daemon=True)
        self.thread.start()

    @classmethod
    def attach(cls, app_name: str, replica_id: str, state: DrainState,
               abort_all: Callable[[], None]) -> ReplicaDrain | None:
        """The replica's drain, where a CLI opened the application's board; else None."""
        import ray

        if not ray.is_initialized():  # Serve's local testing mode
            return None
        board = DrainBoard(app_name, GcsKeyValue())
        try:
            if not board.is_open():  # `serve run`: no CLI, Serve's own drain
                return None
        except ray.exceptions.RayError:
            return None
        return cls(board, replica_id, state, abort_all)

    def _run(self) -> None:
        import ray

        try:
            self.board.register(self.replica_id)
            while (timeout_s := self.board.began()) is None:
                if self.detached.wait(self.poll_s):
                    return
        except ray.exceptions.RayError:  # the GCS is gone: the cluster went without a drain
            return
        logger.info("drain: no new requests; %d open, %.1f s to finish", self.state.in_flight, timeout_s)
        aborted = finish_in_flight(self.state, self.abort_all, timeout_s)
        logger.info("drain: done (%d aborted)", aborted)
        try:
            self.board.report_drained(self.replica_id)
        except ray.exceptions.RayError:
            pass

    def detach(self) -> None:
        """The replica is stopping: the board no longer waits for it."""
        self.detached.set()
        try:
            self.board.unregister(self.replica_id)
        except Exception:  # noqa: BLE001 - Ray may already be shutting down
            pass
