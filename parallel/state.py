"""Who this rank is in its engine's tensor-parallel group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParallelContext:
    """Passed explicitly to every parallel layer; at world_size 1 no communication happens."""

    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed ProcessGroup for tensors (nccl on CUDA, gloo on CPU)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0
