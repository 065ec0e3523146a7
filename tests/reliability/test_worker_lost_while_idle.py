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
