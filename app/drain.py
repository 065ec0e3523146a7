"""Graceful shutdown of `shardserve serve`: stop admitting, let in-flight requests finish, abort the rest.

Ray Serve cannot do this by itself. Its replica drain waits for ongoing requests before it tells user
code anything (`__del__` runs after them), and `serve.shutdown()` kills the HTTP proxy at once, which
cuts every open stream. So the CLI drains the application before it shuts Serve down:

- a `DrainCoordinator`, a small named actor per application that the CLI starts, holds the drain's
  deadline (`--shutdown-timeout` from the signal);
- each replica's `ReplicaDrain` thread waits on it with one long call; once the drain begins, the
  replica's `DrainGate` answers new requests 503 with Retry-After, in-flight requests run on until the
  deadline, the engine then aborts the rest (their streams end with finish_reason "abort" and
  `[DONE]`), and the replica reports that it has drained;
- the CLI waits for every live replica's report (or the deadline plus `ABORT_GRACE_S`), then shuts Serve
  and Ray down. Live means Serve still lists it: a replica that died (its engine, a TP worker, its node) never
  reports, and is not waited for. Every call to the cluster is bounded: a cluster that stopped answering (its
  processes were signalled too) ends the wait at once.

Without a coordinator (`serve run configs/serve.yaml`) replicas skip all of this and Serve's own
drain applies (`graceful_shutdown_timeout_s`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import RETRY_AFTER_S, error_response

logger = logging.getLogger("shardserve.drain")

NAMESPACE = "shardserve"
# after the deadline, how long aborted requests get to write their last chunk before the replica stops waiting
ABORT_GRACE_S = 5.0
POLL_S = 0.05
# the longest the CLI waits on one call to the coordinator or Serve's controller before taking the cluster for gone
CLUSTER_CALL_TIMEOUT_S = 5.0
# how often the drain asks Serve's controller which replicas it still lists
LIVE_REPLICAS_PERIOD_S = 1.0


class ClusterGone(Exception):
    """The Ray cluster stopped answering during the drain (its own processes were signalled too, or died)."""


def coordinator_name(app_name: str) -> str:
    return f"drain-{app_name}"


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


class DrainCoordinator:
    """The named actor of one application (`ray.remote` in `start_coordinator`): the drain's deadline and
    which replicas have drained."""

    def __init__(self):
        self.deadline: float | None = None  # time.monotonic() of this actor's process
        self.began = asyncio.Event()
        self.replicas: set[str] = set()
        self.drained: set[str] = set()

    def register(self, replica_id: str) -> None:
        self.replicas.add(replica_id)

    def unregister(self, replica_id: str) -> None:
        """A replica that Serve stopped (scaled down, replaced) has nothing left to drain."""
        self.replicas.discard(replica_id)

    def begin(self, timeout_s: float) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + timeout_s
            self.began.set()

    async def wait_for_drain(self) -> float:
        """Returns when the drain begins: the seconds left until its deadline (no clocks shared across hosts)."""
        await self.began.wait()
        return max(0.0, self.deadline - time.monotonic())

    def report_drained(self, replica_id: str) -> None:
        self.drained.add(replica_id)

    def pending(self, live: list[str] | None = None) -> list[str]:
        """Replicas that have not drained yet, of those still `live` (all registered ones if None)."""
        replicas = self.replicas if live is None else self.replicas & set(live)
        return sorted(replicas - self.drained)


def start_coordinator(app_name: str):
    """Start the application's DrainCoordinator actor (the CLI does, before `serve.run`); returns its handle."""
    import ray

    actor = ray.remote(DrainCoordinator).options(name=coordinator_name(app_name), namespace=NAMESPACE,
                                                 num_cpus=0, max_concurrency=1000)
    return actor.remote()


def answer(ref, cluster_alive: Callable[[], bool]):
    """The value of one call to the cluster, waited for up to CLUSTER_CALL_TIMEOUT_S while the cluster is alive."""
    import ray

    give_up = time.monotonic() + CLUSTER_CALL_TIMEOUT_S
    while not ray.wait([ref], timeout=POLL_S)[0]:
        if not cluster_alive():
            raise ray.exceptions.RaySystemError("the cluster's own processes have exited")
        if time.monotonic() > give_up:
            raise ray.exceptions.GetTimeoutError(f"no answer within {CLUSTER_CALL_TIMEOUT_S:.0f} s")
    return ray.get(ref)


def live_replicas(app_name: str, cluster_alive: Callable[[], bool]) -> list[str]:
    """The ids of the application's replicas that Serve's controller still lists (starting, running, stopping)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    details = answer(controller.get_serve_instance_details.remote(), cluster_alive)
    app = (details.get("applications") or {}).get(app_name) or {}
    return [replica["replica_id"] for deployment in app.get("deployments", {}).values()
            for replica in deployment.get("replicas", [])]


def drain_application(coordinator, app_name: str, timeout_s: float, hurry: threading.Event,
                      cluster_alive: Callable[[], bool]) -> list[str]:
    """Begin the drain and wait until every live replica has drained, or the deadline plus ABORT_GRACE_S, or
    until `hurry` is set (a second Ctrl-C). Returns the replicas that had not drained; raises ClusterGone when
    the cluster is (`cluster_alive()` False, or a call unanswered)."""
    import ray

    give_up = time.monotonic() + timeout_s + ABORT_GRACE_S + 1.0
    try:
        answer(coordinator.begin.remote(timeout_s), cluster_alive)
        listed_at = -LIVE_REPLICAS_PERIOD_S
        while True:
            if time.monotonic() - listed_at >= LIVE_REPLICAS_PERIOD_S:  # the controller's details are not cheap
                live, listed_at = live_replicas(app_name, cluster_alive), time.monotonic()
            pending = answer(coordinator.pending.remote(live), cluster_alive)
            if not pending or time.monotonic() > give_up or hurry.wait(POLL_S):
                return pending
    except (ray.exceptions.RayError, ValueError) as gone:  # a timeout is a RayError; ValueError: no such actor
        raise ClusterGone(str(gone).splitlines()[0]) from gone


class ReplicaDrain:
    """A replica's link to its application's coordinator: a thread that waits for the drain, then runs it."""

    def __init__(self, coordinator, replica_id: str, state: DrainState, abort_all: Callable[[], None]):
        self.coordinator = coordinator
        self.replica_id = replica_id
        self.state = state
        self.abort_all = abort_all
        self.thread = threading.Thread(target=self._run, name="shardserve-drain", daemon=True)
        self.thread.start()

    @classmethod
    def attach(cls, app_name: str, replica_id: str, state: DrainState,
               abort_all: Callable[[], None]) -> ReplicaDrain | None:
        """The replica's drain, if the application has a coordinator (the CLI started one); else None."""
        import ray

        if not ray.is_initialized():  # Serve's local testing mode
            return None
        try:
            coordinator = ray.get_actor(coordinator_name(app_name), namespace=NAMESPACE)
        except ValueError:  # `serve run`: no coordinator, Serve's own drain
            return None
        return cls(coordinator, replica_id, state, abort_all)

    def _run(self) -> None:
        import ray

        try:
            ray.get(self.coordinator.register.remote(self.replica_id))
            timeout_s = ray.get(self.coordinator.wait_for_drain.remote())
        except ray.exceptions.RayError:  # the coordinator is gone: the CLI left without a drain
            return
        logger.info("drain: no new requests; %d open, %.1f s to finish", self.state.in_flight, timeout_s)
        aborted = finish_in_flight(self.state, self.abort_all, timeout_s)
        logger.info("drain: done (%d aborted)", aborted)
        self.coordinator.report_drained.remote(self.replica_id)

    def detach(self) -> None:
        """The replica is stopping: the coordinator no longer waits for it."""
        try:
            self.coordinator.unregister.remote(self.replica_id)
        except Exception:  # noqa: BLE001 - Ray may already be shutting down
            pass
