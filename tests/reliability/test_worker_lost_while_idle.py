"""A tensor-parallel worker that dies while its engine is idle marks the engine dead on its own: /health and
Serve's health check fail before any request has to find out (the idle loop asks the executor)."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine import AsyncLLMEngine, EngineConfig, EngineDeadError, SamplingParams

DEADLINE_S = 60  # a bound against hangs; the loop checks every IDLE_HEALTH_CHECK_S (0.5 s)


@pytest.mark.timeout(240)
async def test_a_tp_worker_killed_while_idle_marks_the_engine_dead_without_a_request(serve_cluster, tiny_llama_dir):
    import ray

    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", tensor_parallel_size=2,
                                         block_size=8, num_kv_blocks=64, max_model_len=256))
    try:
        assert engine.is_running
        ray.kill(engine.engine.executor.workers[0])
        deadline = time.monotonic() + DEADLINE_S
        while engine.is_running:
            assert time.monotonic() < deadline, "the engine still reports running with a dead worker"
            await asyncio.sleep(0.05)
        assert "worker rank 1 died" in engine.dead_reason
        with pytest.raises(EngineDeadError, match="worker rank 1 died"):
            async for _ in engine.generate([5, 6, 7], SamplingParams(max_tokens=2), "after"):
                pass
    finally:
        engine.shutdown()


@pytest.mark.timeout(240)
async def test_a_loop_stuck_on_a_lost_worker_is_reported_with_where_it_is_stuck(serve_cluster, tiny_llama_dir):
    # A loop that hangs (say in a collective on a peer that died without its sockets closing) never marks the
    # engine dead; Serve's health check then asks `unnoticed_rank_loss`, from its own thread, and fails on it.
    import threading

    import ray

    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", tensor_parallel_size=2,
                                         block_size=8, num_kv_blocks=64, max_model_len=256))
    llm_engine = engine.engine
    entered, release = threading.Event(), threading.Event()

    def stuck_in_a_collective() -> None:  # the loop's idle health check, held as a hung collective would hold it
        entered.set()
        release.wait()

    try:
        llm_engine.check_health = stuck_in_a_collective
        assert await asyncio.to_thread(entered.wait, DEADLINE_S), "the idle loop never checked its workers"
        assert engine.unnoticed_rank_loss(grace_s=0.5) is None  # every rank lives
        ray.kill(llm_engine.executor.workers[0])
        deadline = time.monotonic() + DEADLINE_S
        while (stuck := engine.unnoticed_rank_loss(grace_s=0.5)) is None:
            assert time.monotonic() < deadline, "a lost worker under a stuck loop was never reported"
            await asyncio.sleep(0.05)
        assert engine.is_running  # the loop itself has not noticed: only this report can get the replica replaced
        assert "worker rank 1 is lost" in stuck and "stuck_in_a_collective" in stuck
        del llm_engine.check_health  # the loop's own check again: it marks the engine dead, and the report ends
        release.set()
        while engine.is_running:
            assert time.monotonic() < deadline, "the loop did not act on the lost worker once unstuck"
            await asyncio.sleep(0.05)
        assert "worker rank 1 died" in engine.dead_reason
        assert engine.unnoticed_rank_loss(grace_s=0.0) is None
    finally:
        release.set()
        engine.shutdown()
