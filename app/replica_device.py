"""Where a replica's model runs, decided in the replica from what Ray reserved for it.

The deployment asks Ray for one GPU per rank when `device` is cuda, or when it is auto and the Ray
cluster has GPUs. That is the cluster's resources, not the GPUs of the process that builds the app,
since `serve deploy` and the RayService build it on the head node, which on KubeRay has none. A GPU
fleet whose GPU nodes join later (autoscaling from zero) says `device: cuda`, as configs/rayservice.yaml
does. The replica then runs where Ray put it: on the GPU Ray reserved for it, or on CPU if Ray reserved
none. A replica that was given a GPU but cannot use it (torch without CUDA there, no driver) fails loudly
at start rather than serving on CPU.
"""

from __future__ import annotations

import os
from typing import Literal

from app.config import ServeArgs
from engine.executor.gpu_devices import GPU_RANK_ENV, reserved_gpu_ids


class ReplicaDeviceError(RuntimeError):
    """Ray reserved a GPU for this replica, but the replica's process cannot use one."""


def deployment_wants_gpus(args: ServeArgs) -> bool:
    """Whether each rank's bundle asks Ray for a GPU: `device` cuda, or auto with GPUs in the Ray cluster
    (this machine's, where no Ray is connected yet)."""
    if args.device != "auto":
        return args.device == "cuda"
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


def replica_ray_actor_env(args: ServeArgs) -> dict[str, str]:
    """Environment variables of the replica's actor: a GPU replica sees its node's GPUs and takes the one
    Ray reserved (engine/executor/gpu_devices.py), as its TP workers do."""
    return dict(GPU_RANK_ENV) if deployment_wants_gpus(args) else {}


def replica_device(args: ServeArgs) -> Literal["cpu", "cuda"]:
    """This replica's device, in the replica: with `device` auto, cuda on the GPU Ray reserved for it and
    cpu without one; cuda and cpu as set. A reserved GPU that torch cannot see is an error, not a CPU replica."""
    if args.device == "cpu":
        return "cpu"
    reserved = reserved_gpu_ids()
    if args.device == "auto" and not reserved:
        return "cpu"
    import torch

    if reserved and not torch.cuda.is_available():
        raise ReplicaDeviceError(
            f"Ray reserved GPU {', '.join(reserved)} for this replica (device {args.device}), but torch "
            f"{torch.__version__} sees no CUDA device here (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): install a CUDA build of torch and the GPU driver on "
            "this node, or deploy with device: cpu"
        )
    return "cuda"
