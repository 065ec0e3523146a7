"""Tensor-parallel ranks 1..tp-1 as Ray actors, driven by rank 0 in the engine's own process.

Rank 0 (`TensorParallelExecutor`) owns the block manager's view of the world: every step it
broadcasts the `StepInput` (one pickled message on the gloo metadata group), then runs its own
shard's forward; the workers run the same forward on theirs, and the row-parallel all-reduces
and the LM head's all-gather tie the ranks together. Rank 0 returns the full logits.

Workers run a loop (`TensorParallelWorker.run`: receive a step, run it, until a None step)
rather than one Ray call per step: a step's message then costs two small gloo broadcasts (its
length, its bytes; well under a millisecond each at world size 2) instead of a Ray task
submission, a result object and a `ray.get` per worker per step. Swap preemption works as at
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

import logging
import os
import pickle
import time
import traceback
import weakref
from dataclasses import dataclass

import ray
import torch
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.config import EngineConfig, ModelConfig
from engine.errors import EngineDeadError, EngineError
from engine.model_runner import ModelRunner, StepInput
from parallel.comm import broadcast_object
from parallel.layers import weight_bytes
from parallel.state import (
    RENDEZVOUS_TIMEOUT,
    ParallelContext,
    connect_store,
    create_store,
    init_parallel_context,
)

logger = logging.getLogger(__name__)

# After a failed step, how long rank 0 waits for Ray to report which worker died.
FAILURE_REPORT_TIMEOUT_S = 5.0
# On shutdown, how long workers get to leave their loop before they are killed.
SHUTDOWN_TIMEOUT_S = 10.0
# Offline on CPU, the engine's own placement group reserves this much (logical) CPU per rank.
CPU_PER_RANK = 0.5


class WorkerStartError(EngineError):
    """The tensor-parallel ranks could not be placed, started or connected."""


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds in weights and in KV cache."""

    rank: int
    weight_bytes: int
    kv_cache_bytes: int


def measure_memory(runner: ModelRunner) -> RankMemory:
    """Tensor byte counts of a rank's parameters (a tied head counted once) and KV cache."""
    weights = weight_bytes(runner.model)
    kv = sum(cache.numel() * cache.element_size() for cache in runner.kv_caches)
    return RankMemory(runner.parallel.rank, weights, kv)


def _failure_key(rank: int) -> str:
    return f"failed/{rank}"


def _joined_key(rank: int) -> str:
    return f"joined/{rank}"


@ray.remote(max_concurrency=2)  # `run` holds one thread for the engine's life; queries use the other
class TensorParallelWorker:
    """One rank > 0 of an engine: its shard of the weights, its KV cache, its half of each collective."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        rank: int,
        world_size: int,
        store_port: int,
        max_model_len: int,
    ):
        self.config = config
        self.model_config = model_config
        self.rank = rank
        self.world_size = world_size
        self.store = connect_store(store_port, world_size)
        self.max_model_len = max_model_len
        self.runner: ModelRunner | None = None

    def run(self) -> None:
        """Join the groups, load this rank's shard, then run every step rank 0 broadcasts until None."""
        try:
            device_type = self.config.resolved_device().type
            self.store.set(_joined_key(self.rank), "1")
            parallel = init_parallel_context(self.store, self.rank, self.world_size, device_type)
            self.runner = ModelRunner(
                self.config, self.model_config, parallel=parallel, max_model_len=self.max_model_len
            )
            while (step := broadcast_object(None, parallel)) is not None:
                self.runner.execute_model(step)
            self.runner.shutdown()
        except BaseException as exc:  # noqa: BLE001 - any failure must close this rank's sockets
            self._report_and_exit(exc)

    def _report_and_exit(self, exc: BaseException) -> None:
        """Leave the exception where rank 0 can read it, then exit so peers' collectives fail now."""
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        logger.error("tensor-parallel rank %d failed:\n%s", self.rank, traceback.format_exc())
        try:
            try:
                payload = pickle.dumps(exc)
                pickle.loads(payload)
            except Exception:  # noqa: BLE001 - unpicklable exceptions travel as text
                payload = pickle.dumps(text)
            self.store.set(_failure_key(self.rank), payload)
        except Exception:  # noqa: BLE001 - rank 0 (the store's host) may be gone already
            pass
        os._exit(1)

    def memory(self) -> RankMemory | None:
        return None if self.runner is None else measure_memory(self.runner)

    def gpu_ids(self) -> list[int]:
        return [int(i) for i in ray.get_gpu_ids()]


def ensure_ray(world_size: int) -> None:
    """Connect to Ray if this process is not: the cluster RAY_ADDRESS names, else a new local one
    of this process's own (never an unrelated `ray start` cluster that happens to run here)."""
    if ray.is_initialized():
        return
    # every Ray port on 127.0.0.1 only; must be set before Ray starts
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=logging.WARNING)
        return
    ray.init(
        address="local",
        include_dashboard=False,
        num_cpus=max(os.cpu_count() or 1, world_size),  # CPU bundles are logical: TP=4 fits on 2 cores
        logging_level=logging.WARNING,
    )


@dataclass
class WorkerPlacement:
    """Where ranks 1..tp-1 go: bundles 1..tp-1 of the replica's placement group, or of our own."""

    placement_group: PlacementGroup
    owned: bool  # made by this engine (offline LLM): removed on shutdown

    @classmethod
    def acquire(cls, world_size: int, device_type: str) -> WorkerPlacement:
        current = get_current_placement_group()
        if current is not None:  # inside a Serve replica: never nest a group
            if current.bundle_count < world_size:
                raise WorkerStartError(
                    f"the replica's placement group has {current.bundle_count} bundle(s); tensor_parallel_size "
                    f"{world_size} needs {world_size} (bundle 0 for the replica, 1..{world_size - 1} for workers)"
                )
            return cls(current, owned=False)
        # CPU bundles are logical (CPU tensor parallelism is for correctness): half a CPU per rank
        # leaves room for a TP=4 engine beside others on a small local Ray
        bundle = {"GPU": 1} if device_type == "cuda" else {"CPU": CPU_PER_RANK}
        (resource, amount), = bundle.items()
        if ray.cluster_resources().get(resource, 0) < amount * world_size:
            raise WorkerStartError(
                f"tensor_parallel_size {world_size} needs {world_size} x {bundle} on one Ray node; the cluster has "
                f"{ray.cluster_resources().get(resource, 0):g} {resource} in all"
            )
        group = placement_group([dict(bundle) for _ in range(world_size)], strategy="STRICT_PACK")
        try:
            ray.get(group.ready(), timeout=RENDEZVOUS_TIMEOUT.total_seconds())
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise WorkerStartError(
                f"Ray cannot place {world_size} x {bundle} on one node (STRICT_PACK) within "
                f"{RENDEZVOUS_TIMEOUT.total_seconds():.0f} s: the cluster has {ray.available_resources()} free"
            ) from None
        return cls(group, owned=True)

    def actor_options(self, rank: int) -> dict:
        """Ray options putting `rank`'s actor into bundle `rank`, taking that bundle's resources."""
        bundle = self.placement_group.bundle_specs[rank]
        return dict(
            num_cpus=bundle.get("CPU", 0),
            num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=rank,
                placement_group_capture_child_tasks=True,
            ),
        )

    def release(self) -> None:
        if self.owned:
            remove_placement_group(self.placement_group)


class StartedRanks:
    """What a tensor-parallel executor started besides its own shard: ranks 1..tp-1, their placement,
    and rank 0's groups with them. `release()` frees it all; calling it again does nothing."""

    def __init__(self) -> None:
        self.placement: WorkerPlacement | None = None
        self.workers: list = []
        self.loops: list = []  # each worker's `run` call: resolves when it leaves its loop or dies
        # rank 0's groups while every rank is in step, so the farewell (a None step) can go out on
        # them; None before the ranks are up and after a failure left them out of step
        self.parallel: ParallelContext | None = None

    def release(self) -> None:
        """Stop the workers' loops (or kill them) and free their placement."""
        parallel, self.parallel = self.parallel, None
        workers, loops, placement = self.workers, self.loops, self.placement
        self.workers, self.loops, self.placement = [], [], None
        if not ray.is_initialized():  # at exit after ray.shutdown(): Ray took actors and group with it
            return
        if parallel is not None and loops:
            try:
                broadcast_object(None, parallel)
                ray.wait(loops, num_returns=len(loops), timeout=SHUTDOWN_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a worker already gone: killed below anyway
                pass
        for worker in workers:
            ray.kill(worker)
        if placement is not None:
            placement.release()


class TensorParallelExecutor:
    """Rank 0 of an engine's tensor-parallel group: runs its shard here and drives ranks 1..tp-1.

    The engine's interface is ModelRunner's: `num_blocks`, `execute_model(step)`, `shutdown()`.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int):
        self.world_size = config.tensor_parallel_size
        device_type = config.resolved_device().type
        ensure_ray(self.world_size)
        self._store = create_store(self.world_size)
        self._ranks = StartedRanks()
        self._release = weakref.finalize(self, self._ranks.release)  # shutdown, garbage collection or exit
        self._dead: str | None = None
        self.runner: ModelRunner | None = None
        try:
            placement = self._ranks.placement = WorkerPlacement.acquire(self.world_size, device_type)
            for rank in range(1, self.world_size):
                worker = TensorParallelWorker.options(**placement.actor_options(rank)).remote(
                    config, model_config, rank, self.world_size, self._store.port, max_model_len
                )
                self._ranks.workers.append(worker)
            self._ranks.loops = [worker.run.remote() for worker in self._ranks.workers]
            self._wait_for_workers_to_join()
            if device_type == "cuda" and placement.owned:
                self._use_gpu_no_worker_has()
            parallel = init_parallel_context(self._store, 0, self.world_size, device_type)
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

    def execute_model(self, step: StepInput) -> torch.Tensor | None:
        """Broadcast the step, run rank 0's shard; returns the full logits (all-gathered by the head)."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        try:
            broadcast_object(step, self.runner.parallel)
            return self.runner.execute_model(step)
        except Exception as exc:  # any failure leaves the ranks out of step: the engine is done
            failure = self._worker_failure()
            self._fail(f"tensor-parallel step failed: {_describe(failure if failure is not None else exc)}")
            raise EngineDeadError(self._dead) from exc

    def check_health(self) -> None:
        """Raise EngineDeadError if a worker has died or left its loop (between steps; does not block)."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        ended, _ = ray.wait(self._ranks.loops, num_returns=1, timeout=0)
        if ended:
            failure = self._worker_failure()
            self._fail(f"tensor-parallel worker lost: {_describe(failure or 'a worker left its loop')}")
            raise EngineDeadError(self._dead)

    def _fail(self, reason: str) -> None:
        self._dead = reason
        self._ranks.parallel = None  # out of step: a farewell on the groups could wait for ever
        self.shutdown()

    @property
    def num_host_blocks(self) -> int:
        """Swap preemption's host pool: each rank holds one of this many blocks (its own KV heads)."""
        return self.runner.num_host_blocks

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
            pending = {rank for rank in pending if not self._store.check([_joined_key(rank)])}
            if pending and time.monotonic() > deadline:
                raise WorkerStartError(
                    f"tensor-parallel rank(s) {sorted(pending)} did not start within "
                    f"{RENDEZVOUS_TIMEOUT.total_seconds():.0f} s"
                )

    def _use_gpu_no_worker_has(self) -> None:
        """Offline on a multi-GPU node rank 0 is the driver, outside the group: take a GPU no worker got."""
        taken = {gpu for ids in ray.get([w.gpu_ids.remote() for w in self._ranks.workers]) for gpu in ids}
        free = [index for index in range(torch.cuda.device_count()) if index not in taken]
        if not free:
            raise WorkerStartError(f"no GPU left for rank 0: the workers hold {sorted(taken)}")
        torch.cuda.set_device(free[0])

    def _worker_failure(self) -> BaseException | str | None:
        """What happened to the first worker that failed: its reported exception, or Ray's account."""
        loops = self._ranks.loops
        ready, _ = ray.wait(loops, num_returns=1, timeout=FAILURE_REPORT_TIMEOUT_S)
        for rank in range(1, self.world_size):
            key = _failure_key(rank)
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
