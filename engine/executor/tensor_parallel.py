"""The executor of a tensor-parallel engine: rank 0 in the engine's own process drives ranks 1..tp-1 (Ray actors).

Rank 0 (`TensorParallelExecutor`) owns the block manager's view of the world: every step it
broadcasts the `StepInput` (one pickled message on the gloo metadata group), then runs its own
shard's forward; the workers run the same forward on theirs, and the row-parallel all-reduces
and the LM head's all-gather tie the ranks together. Rank 0 returns the full logits.

The workers and their placement are in engine/executor/ray_ranks.py. Swap preemption works as at
TP=1: each rank copies its own heads of the swapped blocks (engine/swap.py).

Lifecycle: what rank 0 started besides its own shard (the worker actors, an offline engine's
placement group, the groups it shares with them) sits in `StartedRanks`, which a
`weakref.finalize` on the executor releases when the executor is shut down, garbage-collected or
still alive at interpreter exit. The finalizer holds that object, never the executor: a finalizer
that refers to its own object keeps it alive for ever.

Failure: a worker that raises writes its exception to the engine's rendezvous store and exits
its process, so its sockets close. A killed worker closes them too. Rank 0's next collective
then fails at once ("Connection closed by peer"); a peer that is alive but stuck is bounded by
`parallel.state.COLLECTIVE_TIMEOUT` (60 s). Either way rank 0 raises `EngineDeadError` naming
the rank and its cause, and tears the other ranks down.
"""

from __future__ import annotations

import pickle
import time
import weakref
from collections.abc import Callable
from typing import Any

import ray
import torch

from engine.config import EngineConfig, ModelConfig
from engine.errors import EngineDeadError, EngineError
from engine.executor.base import RankMemory, measure_memory
from engine.executor.gpu_devices import RankPlace, check_distinct_gpus, rendezvous_host, use_reserved_gpu
from engine.executor.ray_ranks import (
    StartedRanks,
    TensorParallelWorker,
    WarmUpUnit,
    WorkerPlacement,
    WorkerStartError,
    ensure_ray,
    failure_key,
    joined_key,
)
from engine.model_runner import ModelRunner, StepInput
from engine.sampler import SampledToken, SamplingBatch
from parallel.comm import broadcast_object
from parallel.state import RENDEZVOUS_TIMEOUT, create_store, init_parallel_context

# After a failed step, how long rank 0 waits for Ray to report which worker died.
FAILURE_REPORT_TIMEOUT_S = 5.0


class TensorParallelExecutor:
    """Rank 0 of an engine's tensor-parallel group: runs its shard here and drives ranks 1..tp-1."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int):
        self.world_size = config.tensor_parallel_size
        device_type = config.resolved_device().type
        config = config.model_copy(update={"device": device_type})  # every rank runs where rank 0 decided
        ensure_ray(self.world_size)
        self._store = None
        self._ranks = StartedRanks()
        self._release = weakref.finalize(self, self._ranks.release)  # shutdown, garbage collection or exit
        self._dead: str | None = None
        self.runner: ModelRunner | None = None
        self.places: list[RankPlace] = []  # every rank's node, GPU and device index, rank 0 first
        try:
            placement = self._ranks.placement = WorkerPlacement.acquire(
                self.world_size, device_type, ray.util.get_node_ip_address()
            )
            rank0 = placement.rank0_place()
            self._store = create_store(self.world_size, host=rank0.node_ip)
            for rank in range(1, self.world_size):
                worker = TensorParallelWorker.options(**placement.actor_options(rank)).remote(
                    config, model_config, rank, self.world_size, rank0.node_ip, self._store.port, max_model_len
                )
                self._ranks.workers.append(worker)
            timeout = RENDEZVOUS_TIMEOUT.total_seconds()
            self.places = [rank0, *ray.get([w.place.remote() for w in self._ranks.workers], timeout=timeout)]
            rendezvous_host(self.places)
            check_distinct_gpus(self.places)
            self._ranks.loops = [worker.run.remote() for worker in self._ranks.workers]
            self._wait_for_workers_to_join()
            device = None
            if device_type == "cuda":
                use_reserved_gpu(rank0)
                device = torch.device("cuda", torch.cuda.current_device())
            parallel = init_parallel_context(
                self._store, 0, self.world_size, device_type, host=rank0.node_ip, device=device
            )
            self.runner = ModelRunner(config, model_config, parallel=parallel, max_model_len=max_model_len)
            self._ranks.parallel = parallel
        except BaseException as exc:
            failure = self._worker_failure() if self._ranks.loops else None
            self.shutdown()
            if isinstance(failure, EngineError):
                raise failure from exc  # e.g. a worker's ModelLoadError, as rank 0 would raise it
            if failure is not None:
                raise WorkerStartError(f"tensor-parallel startup failed: {_describe(failure)}") from exc
            raise
        self.num_blocks = self.runner.num_blocks
        # swap preemption's host pool: each rank holds one of this many blocks (its own KV heads)
        self.num_host_blocks = self.runner.num_host_blocks

    def execute_model(self, step: StepInput, sampling: SamplingBatch | None) -> list[SampledToken] | None:
        """Broadcast the step, run rank 0's shard and sample its full logits (all-gathered by the head)."""
        return self._on_every_rank(step, lambda: self.runner.execute_model(step, sampling), "step")

    def check_health(self) -> None:
        """Raise EngineDeadError if a worker has died or left its loop (between steps; does not block)."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self.lost_rank() is not None:
            failure = self._worker_failure()
            self._fail(f"tensor-parallel worker lost: {_describe(failure or 'a worker left its loop')}")
            raise EngineDeadError(self._dead)

    def lost_rank(self) -> str | None:
        """A worker whose loop has ended (it died or left), as Ray reports it, without acting on it: safe from any
        thread while the engine's own thread runs a step (Serve's health check asks it: AsyncLLMEngine)."""
        loops = self._ranks.loops  # the list of this moment (a release swaps in an empty one)
        if not loops:
            return None
        ended, _ = ray.wait(loops, num_returns=1, timeout=0)
        return f"tensor-parallel worker rank {1 + loops.index(ended[0])} is lost" if ended else None

    def warm_up_idle(self) -> bool:
        """One unit of the idle warm-up on every rank (each rank's shard has the same shapes, so the same units):
        rank 0 broadcasts a `WarmUpUnit` in place of a step and runs its own; whether any is left."""
        warm_up = self.runner.linear_warm_up if self.runner is not None else None
        if warm_up is None or warm_up.done:
            return False
        return self._on_every_rank(WarmUpUnit(), self.runner.warm_up_idle, "warm-up")

    def _on_every_rank(self, message: StepInput | WarmUpUnit, run_here: Callable[[], Any], what: str) -> Any:
        """Broadcast `message` to the workers and run rank 0's part (`run_here`); any failure leaves the ranks out of
        step, so the engine is done: EngineDeadError naming the worker that failed, if one did."""
        # a worker that died since the last message (a SIGKILL just before a request): fail now, not in a broadcast
        # that may wait for it (the metadata group has no timeout while the engine is idle)
        self.check_health()
        try:
            broadcast_object(message, self.runner.parallel)
            return run_here()
        except Exception as exc:
            failure = self._worker_failure()
            self._fail(f"tensor-parallel {what} failed: {_describe(failure if failure is not None else exc)}")
            raise EngineDeadError(self._dead) from exc

    def _fail(self, reason: str) -> None:
        self._dead = reason
        self._ranks.parallel = None  # out of step: a farewell on the groups could wait for ever
        self.shutdown()

    def poll_swap_outs(self) -> list[int]:
        """Swap-outs rank 0 finished copying. A slower rank waits for its own copy before it
        writes those blocks again (engine/swap.py), so rank 0's word frees them for the scheduler."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        return self.runner.poll_swap_outs()

    def wait_swap_outs(self) -> list[int]:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        return self.runner.wait_swap_outs()

    def memory(self) -> list[RankMemory]:
        """Every rank's weight and KV-cache bytes, in rank order."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        workers = ray.get([worker.memory.remote() for worker in self._ranks.workers])
        return [measure_memory(self.runner), *workers]

    @property
    def workers(self) -> list:
        """The worker actors, rank 1 first."""
        return list(self._ranks.workers)

    def shutdown(self) -> None:
        """Stop the workers, free their placement, drop this engine's groups; again, it does nothing."""
        self._dead = self._dead or "the engine was shut down"
        self._release()
        if self.runner is not None:
            self.runner.shutdown()
        # the groups close their sockets when the last reference goes (ProcessGroupGloo.shutdown() and
        # abort() leave them open); the runner's layers hold the rest of them
        self.runner = None
        self._store = None

    def _wait_for_workers_to_join(self) -> None:
        """Block until every worker is about to join the groups; fail fast if one dies first."""
        pending = set(range(1, self.world_size))
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
        while pending:
            ready, _ = ray.wait(self._ranks.loops, num_returns=1, timeout=0.1)
            if ready:  # a worker left `run` before joining: it failed
                raise WorkerStartError("a worker failed before joining")
            pending = {rank for rank in pending if not self._store.check([joined_key(rank)])}
            if pending and time.monotonic() > deadline:
                raise WorkerStartError(
                    f"tensor-parallel rank(s) {sorted(pending)} did not start within "
                    f"{RENDEZVOUS_TIMEOUT.total_seconds():.0f} s"
                )

    def _worker_failure(self) -> BaseException | str | None:
        """What happened to the first worker that failed: its reported exception, or Ray's account."""
        loops = self._ranks.loops
        ready, _ = ray.wait(loops, num_returns=1, timeout=FAILURE_REPORT_TIMEOUT_S)
        for rank in range(1, self.world_size):
            key = failure_key(rank)
            if self._store.check([key]):
                reported = pickle.loads(self._store.get(key))
                if isinstance(reported, EngineError):  # e.g. ModelLoadError: re-raised as rank 0's own
                    reported.add_note(f"(raised on tensor-parallel rank {rank})")
                    return reported
                return f"worker rank {rank} raised {_describe(reported)}"
        for ref in ready:
            rank = 1 + loops.index(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                return f"worker rank {rank} died ({_first_line(exc)})"
            except Exception as exc:  # noqa: BLE001
                return f"worker rank {rank} failed ({_first_line(exc)})"
            return f"worker rank {rank} left its loop"
        return None


def _describe(failure: BaseException | str) -> str:
    if isinstance(failure, BaseException):
        return f"{type(failure).__name__}: {failure}"
    return failure


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
