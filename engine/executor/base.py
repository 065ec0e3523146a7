"""What the engine asks of an executor: the one seam between scheduling (rank 0's engine) and the ranks
that hold weights and KV cache.

Two implement it: `SingleProcessExecutor` (engine/executor/single_process.py, the model runner in the
engine's own thread) and `TensorParallelExecutor` (engine/executor/tensor_parallel.py, rank 0 here and
ranks 1..tp-1 as Ray actors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.model_runner import ModelRunner, StepInput
from engine.sampler import SampledToken, SamplingBatch
from parallel.layers import dense_copy_bytes, weight_bytes


class Executor(Protocol):
    """Runs scheduled steps on every rank; rank 0 samples, and its tokens come back."""

    num_blocks: int  # KV blocks every rank holds (the block manager's pool)
    num_host_blocks: int  # swap preemption's host pool; 0 without one

    def execute_model(self, step: StepInput, sampling: SamplingBatch | None) -> list[SampledToken] | None:
        """One forward pass on every rank, then rank 0 samples `sampling`'s sequences (None: nothing to sample)."""
        ...

    def poll_swap_outs(self) -> list[int]:
        """Tickets of swap-outs finished since the last poll (their device blocks may be reused)."""
        ...

    def wait_swap_outs(self) -> list[int]:
        """Block until every swap-out in flight has finished; their tickets."""
        ...

    def check_health(self) -> None:
        """Raise EngineDeadError if a rank is lost (cheap, non-blocking: called while idle)."""
        ...

    def lost_rank(self) -> str | None:
        """A rank that Ray reports lost, without acting on it (any thread, non-blocking); None while all live."""
        ...

    def warm_up_idle(self) -> bool:
        """One unit of work to do while no request runs (engine/warmup.py); whether any is left."""
        ...

    def memory(self) -> list[RankMemory]:
        """Every rank's weight and KV-cache bytes, in rank order."""
        ...

    def shutdown(self) -> None:
        """Release every rank, thread and placement this executor started; idempotent."""
        ...


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds in weights and in KV cache, and in dense copies of packed linear weights (CPU: the
    small-batch kernel's, kernels/linear.py)."""

    rank: int
    weight_bytes: int
    kv_cache_bytes: int
    dense_copy_bytes: int = 0


def measure_memory(runner: ModelRunner) -> RankMemory:
    """Tensor byte counts of a rank's parameters (a tied head counted once) and KV cache."""
    weights = weight_bytes(runner.model)
    kv = sum(cache.numel() * cache.element_size() for cache in runner.kv_caches)
    return RankMemory(runner.parallel.rank, weights, kv, dense_copy_bytes(runner.model))
