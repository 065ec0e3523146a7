"""How much of a GPU the KV cache may take: measured from a profile, as vLLM sizes it.

`gpu_memory_utilization` is this engine's share of the card's total memory: weights, the peak of one
forward pass at the step's token budget (activations, the LM head's logits, the sampler's temporaries),
memory outside torch's allocator that the engine added (CUDA context, cuBLAS workspaces, NCCL buffers),
and the KV cache, which gets what is left. Memory that other processes or engines held when this engine
started is not this engine's, so two engines in one process (or on one card) each take their own share:
at 0.45 each, both fit. A share larger than the memory free at start fails at once, before the weights
load, rather than as a cache of one block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.errors import EngineError

GIB = 2**30


class KVCacheMemoryError(EngineError):
    """The GPU share (gpu_memory_utilization) leaves no room for the KV cache, or is not free to take."""


@dataclass(frozen=True)
class GpuMemoryReading:
    """One reading of the card and of this process's torch allocator, in bytes."""

    free: int  # on the card, for everyone
    total: int
    allocated: int  # in live torch tensors of this process
    reserved: int  # held by torch's caching allocator (allocated plus its cached blocks)
    peak_allocated: int  # the most `allocated` reached since the last reset

    @property
    def non_torch(self) -> int:
        """Used on the card outside this process's torch allocator: CUDA contexts, NCCL, other processes."""
        return self.total - self.free - self.reserved


class GpuMemory(Protocol):
    """What the sizing reads from a device (torch.cuda's counters; the tests give a stand-in)."""

    def read(self) -> GpuMemoryReading: ...

    def reset_peak(self) -> None: ...

    def release_cached(self) -> None: ...


class CudaMemory:
    """torch.cuda's counters for one device; every reading waits for the device's queued work first."""

    def __init__(self, device: torch.device):
        self.device = device

    def read(self) -> GpuMemoryReading:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return GpuMemoryReading(
            free=free,
            total=total,
            allocated=torch.cuda.memory_allocated(self.device),
            reserved=torch.cuda.memory_reserved(self.device),
            peak_allocated=torch.cuda.max_memory_allocated(self.device),
        )

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def release_cached(self) -> None:
        torch.cuda.empty_cache()


def gpu_memory_for(device: torch.device) -> GpuMemory | None:
    """The memory counters the KV sizing profiles on, or None where the cache is sized without a profile (CPU)."""
    return CudaMemory(device) if device.type == "cuda" else None


def check_share_is_free(at_start: GpuMemoryReading, utilization: float) -> None:
    """The share this engine may fill must be free when it starts (others' memory is not ours to count)."""
    requested = utilization * at_start.total
    if at_start.free < requested:
        raise KVCacheMemoryError(
            f"gpu_memory_utilization {utilization:g} asks for {requested / GIB:.2f} GiB of the GPU's "
            f"{at_start.total / GIB:.2f} GiB, but only {at_start.free / GIB:.2f} GiB are free (another engine or "
            f"process holds the rest): lower gpu_memory_utilization, e.g. to "
            f"{max(0.01, at_start.free / at_start.total - 0.01):.2f}, or set num_kv_blocks"
        )


@dataclass(frozen=True)
class KVCacheBudget:
    """The profile's account of this engine's share, in bytes."""

    share: int  # utilization x total
    torch_peak: int  # weights plus the profiled forward's peak, above what torch held at start
    non_torch: int  # memory outside torch's allocator that appeared since the start
    kv_cache: int  # what is left for the KV cache

    def describe(self) -> str:
        return (
            f"share {self.share / GIB:.2f} GiB = weights and activation peak {self.torch_peak / GIB:.2f} GiB + "
            f"non-torch {self.non_torch / GIB:.2f} GiB + KV cache {self.kv_cache / GIB:.2f} GiB"
        )


def kv_cache_budget(
    at_start: GpuMemoryReading, after_profile: GpuMemoryReading, utilization: float
) -> KVCacheBudget:
    """The KV cache's bytes: the share, less what the weights and the profiled forward reached, less the
    memory outside torch (context, NCCL) that appeared meanwhile."""
    share = int(utilization * at_start.total)
    torch_peak = max(after_profile.peak_allocated, after_profile.allocated) - at_start.allocated
    non_torch = max(0, after_profile.non_torch - at_start.non_torch)
    return KVCacheBudget(share, torch_peak, non_torch, share - torch_peak - non_torch)
