"""Tensor-parallel collectives over a replica's process group; identity at world size 1."""

from __future__ import annotations

import pickle
from typing import Any

import torch

from parallel.state import ParallelContext


def all_reduce(tensor: torch.Tensor, parallel: ParallelContext) -> torch.Tensor:
    """Sum `tensor` over every rank of the group (in place where possible); returns the sum."""
    if parallel.world_size == 1:
        return tensor
    import torch.distributed as dist

    dist.all_reduce(tensor, group=parallel.group)
    return tensor


def all_gather(tensor: torch.Tensor, parallel: ParallelContext, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `tensor` along `dim`, in rank order."""
    if parallel.world_size == 1:
        return tensor
    import torch.distributed as dist

    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(parallel.world_size)]
    dist.all_gather(parts, tensor, group=parallel.group)
    return torch.cat(parts, dim=dim)


def broadcast_object(obj: Any, parallel: ParallelContext) -> Any:
    """Rank 0 sends `obj` (pickled, one message: a length, then the bytes) on the metadata group;
    every other rank passes None and gets rank 0's object back."""
    import torch.distributed as dist

    group = parallel.metadata_group
    if parallel.rank == 0:
        payload = torch.frombuffer(
            bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8
        )
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        dist.broadcast(length, group_src=0, group=group)
        dist.broadcast(payload, group_src=0, group=group)
        return obj
    length = torch.empty(1, dtype=torch.int64)
    dist.broadcast(length, group_src=0, group=group)
    payload = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(payload, group_src=0, group=group)
    return pickle.loads(payload.numpy().tobytes())


def min_over_ranks(value: int, parallel: ParallelContext) -> int:
    """The smallest of every rank's `value` (e.g. how many KV blocks fit), on the metadata group."""
    if parallel.world_size == 1:
        return value
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=parallel.metadata_group)
    return int(tensor.item())
