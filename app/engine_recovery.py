"""What a replica does when its engine dies: rebuild the engine in the same process, or exit so that Serve
replaces the replica.

A rebuild in place skips what a new replica pays before its engine even starts: a Ray worker process, its imports
(torch) and Serve's set-up of the replica, about 8 s of the 12.5 s a replica took to serve again after one of its
TP workers was killed, on the 2-core AVX2 EPYC (docs/OPERATIONS.md, "Failures and recovery"). It is tried once
per REBUILD_WINDOW_S: an engine that dies again that soon after its rebuild (a device left unusable, a checkpoint
that no longer loads, memory that ran out) takes the process with it, and Serve starts a new replica, as vLLM's
server exits when its engine dies; so does a rebuild that fails, and a death while the replica drains. While
the rebuild runs, Serve's health check passes (three failed checks, ~3 s, would have Serve kill the replica
before the rebuild ends) for at most REBUILD_TIMEOUT_S; requests meanwhile get 503 with Retry-After, as from
a dead engine, and the streams of the dead engine have had their error event.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from app.drain import POLL_S, DrainState

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine

logger = logging.getLogger("shardserve.deployment")

# a second death within this long of a rebuild exits the process instead
REBUILD_WINDOW_S = 300.0
# how long the health check passes while a rebuild runs (a rebuild that hangs past it gets the replica killed)
REBUILD_TIMEOUT_S = 120.0
# after the engine died, how long open requests get to write their error event before the replica exits
DEAD_ENGINE_EXIT_GRACE_S = 2.0


class EngineRecovery:
    """One replica's answer to its engine's death (AsyncLLMEngine's on_dead), and whether a rebuild is under way."""

    def __init__(self, drain_state: DrainState, exit_process: Callable[[DrainState, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.engine: AsyncLLMEngine | None = None  # set once built (`attach`); a death before that exits
        self.drain_state = drain_state
        self.exit_process = exit_process or exit_replica_after_dead_engine
        self.clock = clock
        self.last_rebuild: float | None = None
        self.rebuilding_since: float | None = None
        self.rebuilds = 0
        self.lock = threading.Lock()

    def attach(self, engine: AsyncLLMEngine) -> None:
        """The engine this replica rebuilds when it dies."""
        self.engine = engine

    def engine_died(self, reason: str) -> None:
        """On the dead engine's loop thread (its on_dead): rebuild it in place, or exit the process."""
        now = self.clock()
        with self.lock:
            recent = self.last_rebuild is not None and now - self.last_rebuild < REBUILD_WINDOW_S
            engine = self.engine
            exits = recent or self.drain_state.draining or engine is None
            if not exits:
                self.last_rebuild = self.rebuilding_since = now
        if exits:
            why = ("it died again soon after its rebuild" if recent else
                   "the replica is draining" if self.drain_state.draining else "before the replica was ready")
            self.exit_process(self.drain_state, f"{reason} ({why})")
            return
        logger.error("the engine died (%s): rebuilding it in this replica", reason)
        try:
            engine.restart()
        except BaseException as error:  # noqa: BLE001 - any failure of the rebuild ends the process
            logger.exception("the engine's rebuild failed")
            self.exit_process(self.drain_state, f"{reason}; its rebuild failed: {error!r}")
            return
        finally:
            with self.lock:
                self.rebuilding_since = None
        self.rebuilds += 1
        logger.info("the engine was rebuilt in %.1f s", self.clock() - now)

    def rebuilding(self) -> bool:
        """Whether a rebuild is under way, and not for longer than REBUILD_TIMEOUT_S (Serve's health check)."""
        with self.lock:
            since = self.rebuilding_since
        return since is not None and self.clock() - since < REBUILD_TIMEOUT_S


def exit_replica_after_dead_engine(state: DrainState, reason: str, grace_s: float = DEAD_ENGINE_EXIT_GRACE_S) -> None:
    """A replica without an engine serves nothing: its process exits, and Serve, which notices a dead replica at
    once, starts a new one then rather than after three failed health checks. Requests still open (their error
    events on the way out) get up to `grace_s` to end first."""
    deadline = time.monotonic() + grace_s
    while state.in_flight and time.monotonic() < deadline:
        time.sleep(POLL_S)
    logger.error("the engine died (%s): this replica exits so that Serve replaces it now", reason)
    logging.shutdown()
    os._exit(1)
