"""Who this rank is in its engine's tensor-parallel group, and how that group is formed.

Each engine makes its own groups: rank 0 hosts a `TCPStore` on a free port of its node's address
(as Ray reports it: 127.0.0.1 on a loopback-only machine) and every rank builds its process groups on
that store directly (no `init_process_group`, whose default group is process-global), so two engines
in one process or on one host never share a port or a group. Each rank's gloo device binds its own
node's address, so a rank placed on another node reaches rank 0 over the network rather than failing
on a loopback address that is not rank 0's.

Two groups per engine:
- `group` carries the forward pass's tensors (NCCL on CUDA, bound to the rank's own device; gloo on
  CPU, or as a stand-in on CUDA where ranks share one GPU). Its timeout bounds a wait on a peer that
  is alive but stuck; a peer that dies closes its sockets, which gloo and NCCL report at once.
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


def create_store(world_size: int, host: str = LOOPBACK) -> Any:
    """Rank 0's rendezvous store on a free port (the OS picks it: read `store.port`); `host` is the address
    the other ranks reach it at (rank 0's node address)."""
    from torch.distributed import TCPStore

    return TCPStore(host, 0, world_size, is_master=True, timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False)


def connect_store(host: str, port: int, world_size: int) -> Any:
    """A worker rank's client of rank 0's store, at rank 0's node address."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, world_size, is_master=False, timeout=RENDEZVOUS_TIMEOUT)


def _gloo_group(store: Any, prefix: str, rank: int, world_size: int, timeout: timedelta, host: str) -> Any:
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size, options)


def _nccl_group(store: Any, prefix: str, rank: int, world_size: int, timeout: timedelta, device: Any) -> Any:
    """NCCL bound to this rank's GPU from the start (torch's `device_id`): the communicator is made for
    that device now, not guessed from the rank at the first collective."""
    import torch.distributed as dist

    if not dist.is_nccl_available():
        raise RuntimeError("tensor parallelism on CUDA needs a torch build with NCCL")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    group = dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, world_size, options)
    group.eager_connect_single_device(device)
    return group


def init_parallel_context(
    store: Any,
    rank: int,
    world_size: int,
    device_type: str,
    *,
    host: str = LOOPBACK,
    device: Any = None,
    tensor_backend: str | None = None,
) -> ParallelContext:
    """Join this engine's groups (blocks until every rank has joined); returns this rank's context.
    `host`: this rank's node address (gloo binds it); `device`: its CUDA device (NCCL binds it);
    `tensor_backend`: "nccl" or "gloo" for the forward's tensors (default: NCCL on CUDA, gloo on CPU;
    gloo on CUDA stands in where ranks share one GPU, which NCCL refuses)."""
    tensor_backend = tensor_backend or ("nccl" if device_type == "cuda" else "gloo")
    if tensor_backend == "nccl":
        if device is None:
            raise ValueError("an NCCL group needs this rank's CUDA device")
        group = _nccl_group(store, "tensor/", rank, world_size, COLLECTIVE_TIMEOUT, device)
    else:
        group = _gloo_group(store, "tensor/", rank, world_size, COLLECTIVE_TIMEOUT, host)
    cpu_group = _gloo_group(store, "metadata/", rank, world_size, IDLE_TIMEOUT, host)
    return ParallelContext(rank=rank, world_size=world_size, group=group, cpu_group=cpu_group)
