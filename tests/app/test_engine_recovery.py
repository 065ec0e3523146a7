"""app/engine_recovery.py's policy: a replica rebuilds a dead engine in place once per window, else its process
exits (the real rebuild: tests/reliability/test_engine_step_failure.py and, served, test_serve_recovery.py)."""

from __future__ import annotations

import pytest

from app.drain import DrainState
from app.engine_recovery import REBUILD_TIMEOUT_S, REBUILD_WINDOW_S, EngineRecovery


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Engine:
    """Stands in for AsyncLLMEngine.restart: records the call, and what `rebuilding()` said during it."""

    def __init__(self, recovery_box: list, fails: bool = False):
        self.recovery_box = recovery_box
        self.fails = fails
        self.restarts = 0
        self.rebuilding_during = []

    def restart(self) -> None:
        self.restarts += 1
        self.rebuilding_during.append(self.recovery_box[0].rebuilding())
        if self.fails:
            raise RuntimeError("the checkpoint is gone")


@pytest.fixture
def replica():
    clock, exits, state = Clock(), [], DrainState()
    box: list = []
    recovery = EngineRecovery(state, exit_process=lambda state, reason: exits.append(reason), clock=clock)
    box.append(recovery)
    engine = Engine(box)
    recovery.attach(engine)
    return recovery, engine, clock, exits, state


def test_the_first_death_rebuilds_the_engine_in_place_and_health_passes_meanwhile(replica):
    recovery, engine, clock, exits, _ = replica
    recovery.engine_died("worker rank 1 died")
    assert (engine.restarts, exits, engine.rebuilding_during) == (1, [], [True])
    assert not recovery.rebuilding() and recovery.rebuilds == 1


def test_a_second_death_within_the_window_exits_the_process_and_one_after_it_rebuilds_again(replica):
    recovery, engine, clock, exits, _ = replica
    recovery.engine_died("first")
    clock.now += REBUILD_WINDOW_S - 1
    recovery.engine_died("second")
    assert engine.restarts == 1 and exits == ["second (it died again soon after its rebuild)"]
    clock.now += 2
    recovery.engine_died("third")
    assert engine.restarts == 2 and len(exits) == 1


def test_a_failed_rebuild_exits_the_process(replica):
    recovery, _, _, exits, _ = replica
    recovery.attach(Engine([recovery], fails=True))
    recovery.engine_died("worker rank 1 died")
    assert exits == ["worker rank 1 died; its rebuild failed: RuntimeError('the checkpoint is gone')"]
    assert not recovery.rebuilding()


def test_a_death_while_draining_exits_without_a_rebuild(replica):
    recovery, engine, _, exits, state = replica
    state.draining = True
    recovery.engine_died("worker rank 1 died")
    assert engine.restarts == 0 and exits == ["worker rank 1 died (the replica is draining)"]


def test_a_death_before_the_engine_was_attached_exits(replica):
    _, _, clock, exits, state = replica
    recovery = EngineRecovery(state, exit_process=lambda state, reason: exits.append(reason), clock=clock)
    recovery.engine_died("worker rank 1 died")
    assert exits == ["worker rank 1 died (before the replica was ready)"]


def test_health_passes_during_a_rebuild_for_at_most_the_timeout(replica):
    recovery, _, clock, _, _ = replica
    recovery.rebuilding_since = clock.now
    assert recovery.rebuilding()
    clock.now += REBUILD_TIMEOUT_S
    assert not recovery.rebuilding()  # a rebuild that hangs: Serve's health check fails, and it kills the replica
