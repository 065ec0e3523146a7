"""A linear layer's matrix product, x W^T (+ bias): torch's F.linear, or oneDNN's on a weight packed once.

Unpacked, each F.linear call on CPU reorders the weight into oneDNN's blocked layout before it
multiplies; packed once at load, a bench-model decode step's matrix products run 1.3-1.7x faster at
batch 1-50 (docs/BENCHMARKS.md, "Kernels"). bfloat16 results are bit-identical to F.linear's; float32's
differ in the last bits (another summation order). The kernel backend chooses the packer
(kernels/backend.py); the parallel layers only hold what it returns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinearWeight:
    """A [out, in] CPU weight in oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [n, in] -> [n, out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedLinearWeight | None) -> torch.Tensor:
    """x W^T (+ bias) with the packed copy where there is one."""
    if packed is not None:
        return packed.matmul(x, bias)
    return F.linear(x, weight, bias)


def no_packing(weight: torch.Tensor) -> None:
    """The torch and Triton backends multiply the weight as it is."""
    return None


def pack_for_onednn(weight: torch.Tensor) -> PackedLinearWeight | None:
    """The native CPU backend's packer: a CPU float32 or bfloat16 weight, packed; anything else as it is, and so
    is a bfloat16 weight on a CPU whose oneDNN cannot pack one (it needs AVX-512 or AVX-NE-CONVERT; on AVX2 alone
    its reorder raises, and F.linear still multiplies bfloat16)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES:
        return None
    try:
        return PackedLinearWeight(weight)
    except RuntimeError:
        if weight.dtype != torch.bfloat16:
            raise
        return None
