"""Ranks 1..tp-1 of a tensor-parallel engine: Ray actors, their placement, and what rank 0 started.

Workers run a loop (`TensorParallelWorker.run`: receive a step, run it, until a None step; a `WarmUpUnit` in place of
a step runs one unit of the idle warm-up)
rather than one Ray call per step: a step's message then costs two small gloo broadcasts (its
length, its bytes; well under a millisecond each at world size 2) instead of a Ray task
submission, a result object and a `ray.get` per worker per step.

A worker that raises writes its exception to the engine's rendezvous store and exits its process,
so its sockets close and rank 0's next collective fails at once (engine/executor/tensor_parallel.py).
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import traceback
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
from engine.errors import EngineError
from engine.executor.base import RankMemory, measure_memory
from engine.executor.gpu_devices import GPU_RANK_ENV, RankPlace, this_process, use_reserved_gpu
from engine.model_runner import ModelRunner
from parallel.comm import broadcast_object
from parallel.state import RENDEZVOUS_TIMEOUT, ParallelContext, connect_store, init_parallel_context

logger = logging.getLogger("shardserve.executor")

# On shutdown, how long workers get to leave their loop before they are killed.
SHUTDOWN_TIMEOUT_S = 10.0
# Offline on CPU, the engine's own placement group reserves this much (logical) CPU per rank.
CPU_PER_RANK = 0.5
# Offline, bundle 0 asks for a sliver of the driver's node resource, so the group lands on rank 0's node.
NODE_AFFINITY = 0.001


class WorkerStartError(EngineError):
    """The tensor-parallel ranks could not be placed, started or connected."""


@dataclass(frozen=True)
class WarmUpUnit:
    """Rank 0's word, in place of a step, to run one unit of the idle warm-up (engine/warmup.py LinearWarmUp): every
    rank builds the same primitives for its own shard, with no collective between them."""


def failure_key(rank: int) -> str:
    return f"failed/{rank}"


def joined_key(rank: int) -> str:
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
        store_host: str,
        store_port: int,
        max_model_len: int,
    ):
        self.config = config
        self.model_config = model_config
        self.rank = rank
        self.world_size = world_size
        self.store = connect_store(store_host, store_port, world_size)
        self.max_model_len = max_model_len
        self.runner: ModelRunner | None = None
        # set once `run` has built this rank's runner (or failed): queries on the other thread wait for it, since
        # rank 0 can finish its own load while this rank is still building its runner after the last collective
        self.loaded = threading.Event()

    def place(self) -> RankPlace:
        """Where Ray put this rank: its node's address, its reserved GPU and what its process sees."""
        return this_process(self.rank)

    def run(self) -> None:
        """Join the groups, load this rank's shard, then run every step rank 0 broadcasts until None."""
        try:
            device_type = self.config.resolved_device().type
            place = self.place()
            device = None
            if device_type == "cuda":
                use_reserved_gpu(place)
                device = torch.device("cuda", torch.cuda.current_device())
            self.store.set(joined_key(self.rank), "1")
            parallel = init_parallel_context(
                self.store, self.rank, self.world_size, device_type, host=place.node_ip, device=device
            )
            self.runner = ModelRunner(
                self.config, self.model_config, parallel=parallel, max_model_len=self.max_model_len
            )
            self.loaded.set()
            while (step := broadcast_object(None, parallel)) is not None:
                if isinstance(step, WarmUpUnit):
                    self.runner.warm_up_idle()
                else:
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
            self.store.set(failure_key(self.rank), payload)
        except Exception:  # noqa: BLE001 - rank 0 (the store's host) may be gone already
            pass
        os._exit(1)

    def _loaded_runner(self) -> ModelRunner:
        """This rank's runner, once `run` has built it (a failed load exits the process instead)."""
        if not self.loaded.wait(RENDEZVOUS_TIMEOUT.total_seconds()):
            raise EngineError(f"tensor-parallel rank {self.rank} did not load its shard in {RENDEZVOUS_TIMEOUT}")
        return self.runner

    def memory(self) -> RankMemory:
        return measure_memory(self._loaded_runner())

    def warm_up_left(self) -> int | None:
        """Units of the idle warm-up this rank has still to run (None: it has none, e.g. on a GPU)."""
        warm_up = self._loaded_runner().linear_warm_up
        return None if warm_up is None else len(warm_up.units)


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
    # offline on GPU: an actor in bundle 0 that holds rank 0's GPU for the driver, which runs rank 0
    rank0_holder: object | None = None

    @classmethod
    def acquire(cls, world_size: int, device_type: str, node_ip: str = "127.0.0.1") -> WorkerPlacement:
        """The replica's own group inside Serve; offline, a new STRICT_PACK group whose bundle 0 sits on
        `node_ip`, the driver's node (rank 0 runs in the driver, on bundle 0's GPU)."""
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
        bundles = [dict(bundle) for _ in range(world_size)]
        bundles[0][f"node:{node_ip}"] = NODE_AFFINITY
        group = placement_group(bundles, strategy="STRICT_PACK")
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
        """Ray options putting `rank`'s actor into bundle `rank`, taking that bundle's CPUs and GPU; a GPU
        rank sees its node's GPUs (engine/executor/gpu_devices.py)."""
        bundle = self.placement_group.bundle_specs[rank]
        options = dict(
            num_cpus=bundle.get("CPU", 0),
            num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=rank,
                placement_group_capture_child_tasks=True,
            ),
        )
        if bundle.get("GPU", 0):
            options["runtime_env"] = {"env_vars": dict(GPU_RANK_ENV)}
        return options

    def rank0_place(self) -> RankPlace:
        """Rank 0's place: this process, on bundle 0's GPU. Inside Serve the replica is bundle 0's actor and
        holds that GPU itself; offline the driver is outside the group, so an actor takes bundle 0's GPU
        for it and reports which one Ray reserved."""
        if self.owned and self.placement_group.bundle_specs[0].get("GPU", 0):
            if self.rank0_holder is None:
                self.rank0_holder = Rank0Reservation.options(**self.actor_options(0)).remote()
            gpu_ids = ray.get(self.rank0_holder.gpu_ids.remote(), timeout=RENDEZVOUS_TIMEOUT.total_seconds())
            return this_process(0, gpu_ids=tuple(gpu_ids))
        return this_process(0)

    def release(self) -> None:
        if self.rank0_holder is not None:
            ray.kill(self.rank0_holder)
            self.rank0_holder = None
        if self.owned:
            remove_placement_group(self.placement_group)


@ray.remote(num_cpus=0)
class Rank0Reservation:
    """Holds bundle 0's GPU for an offline engine's rank 0 (the driver, which Ray gives no resources)."""

    def gpu_ids(self) -> list[str]:
        return [str(gpu) for gpu in ray.get_gpu_ids()]


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
