"""Which GPU and which address each rank of an engine uses, taken from what Ray reserved for it.

Ray reserves a GPU per rank (a placement-group bundle each) and names it by its id on the node. A rank
does not let Ray narrow its process to that one GPU: every GPU rank runs with
RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, so it sees the node's GPUs and takes the one Ray reserved
by its index among them (vLLM's local rank). Narrowed to one GPU each, NCCL's ranks cannot see one
another's devices and fall back from P2P, or hang, on H200/NVSwitch nodes (ray-project/ray#61073,
NVIDIA-NeMo/RL#1963). The index is Ray's id looked up in the process's own CUDA_VISIBLE_DEVICES, since a
node that narrows it (`CUDA_VISIBLE_DEVICES=2,3`) gives Ray ids 2 and 3 but torch indices 0 and 1.

The rendezvous address is rank 0's node address as Ray reports it; every rank must be on that node
(one placement group, STRICT_PACK, with bundle 0 on rank 0's node).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from engine.errors import EngineError

NOSET_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
GPU_RANK_ENV = {NOSET_VISIBLE_DEVICES: "1"}  # the runtime_env env_vars of every GPU rank's Ray actor


class GpuPlacementError(EngineError):
    """Ray's reservation and what a rank's process can see disagree (or the ranks are on different nodes)."""


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs, as Ray placed it, and the CUDA device that follows from it."""

    rank: int
    node_ip: str
    gpu_ids: tuple[str, ...]  # Ray's ids of the GPUs reserved for this rank (empty on CPU)
    visible_devices: str | None  # the process's CUDA_VISIBLE_DEVICES (None: unset, every GPU)

    @property
    def cuda_index(self) -> int | None:
        """The torch device index of the rank's reserved GPU, or None without a reservation."""
        return None if not self.gpu_ids else cuda_index(self.gpu_ids[0], self.visible_devices)


def cuda_index(gpu_id: str, visible_devices: str | None) -> int:
    """torch's index of the GPU that Ray calls `gpu_id`, in a process whose CUDA_VISIBLE_DEVICES is
    `visible_devices` (None: unset, so torch's indices are the node's)."""
    if visible_devices is None:
        return int(gpu_id)
    visible = [entry.strip() for entry in visible_devices.split(",") if entry.strip()]
    if gpu_id not in visible:
        raise GpuPlacementError(
            f"Ray reserved GPU {gpu_id} for this rank, but its process sees CUDA_VISIBLE_DEVICES={visible_devices!r}"
        )
    return visible.index(gpu_id)


def reserved_gpu_ids() -> tuple[str, ...]:
    """Ray's ids of the GPUs reserved for this process (a Ray actor or task); () outside Ray or for a driver."""
    ray = sys.modules.get("ray")  # never imported for it: an offline engine without Ray has no reservation
    if ray is None or not ray.is_initialized():
        return ()
    return tuple(str(gpu) for gpu in ray.get_gpu_ids())


def this_process(rank: int, gpu_ids: tuple[str, ...] | None = None) -> RankPlace:
    """Where this process runs (its node's address from Ray, else loopback) and the GPUs reserved for it
    (`gpu_ids`, e.g. a bundle's that a stand-in actor holds for it; default: its own reservation)."""
    ray = sys.modules.get("ray")
    node_ip = ray.util.get_node_ip_address() if ray is not None and ray.is_initialized() else "127.0.0.1"
    ids = reserved_gpu_ids() if gpu_ids is None else tuple(gpu_ids)
    return RankPlace(rank, node_ip, ids, os.environ.get("CUDA_VISIBLE_DEVICES"))


def rendezvous_host(places: list[RankPlace]) -> str:
    """Rank 0's node address, once every rank is known to be on that node; places: every rank's, rank 0 first."""
    host = places[0].node_ip
    elsewhere = [place.rank for place in places if place.node_ip != host]
    if elsewhere:
        raise GpuPlacementError(
            f"tensor-parallel rank(s) {elsewhere} run on another node than rank 0 ({host}): "
            + ", ".join(f"rank {place.rank} on {place.node_ip}" for place in places)
        )
    return host


def check_distinct_gpus(places: list[RankPlace]) -> None:
    """Every GPU rank holds its own GPU: two ranks on one device would deadlock NCCL."""
    owners: dict[str, int] = {}
    for place in places:
        for gpu in place.gpu_ids:
            if gpu in owners:
                raise GpuPlacementError(f"ranks {owners[gpu]} and {place.rank} were both given GPU {gpu}")
            owners[gpu] = place.rank


def use_reserved_gpu(place: RankPlace) -> None:
    """Make the rank's reserved GPU torch's current device (nothing to do without a reservation)."""
    index = place.cuda_index
    if index is None:
        return
    import torch

    if index >= torch.cuda.device_count():
        raise GpuPlacementError(
            f"rank {place.rank}: Ray reserved GPU {place.gpu_ids[0]} (index {index}), but torch sees "
            f"{torch.cuda.device_count()} GPU(s) with CUDA_VISIBLE_DEVICES={place.visible_devices!r}"
        )
    torch.cuda.set_device(index)
