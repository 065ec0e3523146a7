"""Who this rank is in its engine's tensor-parallel group, and how that group is formed.

Each engine makes its own groups: rank 0 hosts a `TCPStore` on a free 127.0.0.1 port and every
rank builds its process groups on that store directly (no `init_process_group`, whose default
group is process-global), so two engines in one process or on one host never share a port or a
group. STRICT_PACK placement keeps every rank of an engine on one node, hence loopback.

Two groups per engine:
- `group` carries the forward pass's tensors (NCCL on CUDA, gloo on CPU). Its timeout bounds a
  wait on a peer that is alive but stuck; a peer that dies closes its sockets, which gloo and
  NCCL report at once.
- `cpu_group` (gloo) carries step metadata and small CPU collectives. Workers wait on it
  between steps for as long as the engine is idle, so its timeout is effectively unbounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

# A forward pass's collective waits at most this long for a live peer (a dead peer fails at once).
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
# Workers block on the metadata group while the engine has nothing to do.
IDLE_TIMEOUT = timedelta(days=365)
# How long ranks wait for one another to connect to the store and to join a group.
RENDEZVOUS_TIMEOUT = timedelta(seconds=120)
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ParallelContext:
    """Passed explicitly to every parallel layer; at world_size 1 no communication happens."""

    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed ProcessGroup for tensors (nccl on CUDA, gloo on CPU)
    cpu_group: Any = None  # gloo ProcessGroup for step metadata; None: use `group`

    @property
    def metadata_group(self) -> Any:
        return self.cpu_group if self.cpu_group is not None else self.group


def create_store(world_size: int) -> Any:
    """Rank 0's rendezvous store on a free loopback port (the OS picks it: read `store.port`)."""
    from torch.distributed import TCPStore

    return TCPStore(
        LOOPBACK, 0, world_size, is_master=True, timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False
    )


def connect_store(port: int, world_size: int) -> Any:
    """A worker rank's client of rank 0's store."""
    from torch.distributed import TCPStore

    return TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=RENDEZVOUS_TIMEOUT)


def _gloo_group(store: Any, prefix: str, rank: int, world_size: int, timeout: timedelta) -> Any:
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size, options)


def _nccl_group(store: Any, prefix: str, rank: int, world_size: int, timeout: timedelta) -> Any:
    import torch.distributed as dist

    if not dist.is_nccl_available():
        raise RuntimeError("tensor parallelism on CUDA needs a torch build with NCCL")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, world_size, options)


def init_parallel_context(store: Any, rank: int, world_size: int, device_type: str) -> ParallelContext:
    """Join this engine's groups (blocks until every rank has joined); returns this rank's context."""
    make_tensor_group = _nccl_group if device_type == "cuda" else _gloo_group
    group = make_tensor_group(store, "tensor/", rank, world_size, COLLECTIVE_TIMEOUT)
    cpu_group = _gloo_group(store, "metadata/", rank, world_size, IDLE_TIMEOUT)
    return ParallelContext(rank=rank, world_size=world_size, group=group, cpu_group=cpu_group)
