"""Executors: how an engine's steps reach the ranks that hold its weights and KV cache (engine/executor/base.py)."""

from __future__ import annotations

from engine.config import EngineConfig, ModelConfig
from engine.executor.base import Executor, RankMemory


def make_executor(config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> Executor:
    """The single-process executor at tensor_parallel_size 1, else rank 0 of a tensor-parallel group
    (which imports Ray only when it is needed)."""
    if config.tensor_parallel_size == 1:
        from engine.executor.single_process import SingleProcessExecutor

        return SingleProcessExecutor(config, model_config, max_model_len)
    from engine.executor.tensor_parallel import TensorParallelExecutor

    return TensorParallelExecutor(config, model_config, max_model_len)


__all__ = ["Executor", "RankMemory", "make_executor"]
