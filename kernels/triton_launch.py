"""What the Triton wrappers need to know about where they run: interpreter or GPU, and its size."""

from __future__ import annotations

import functools

import torch


def is_interpreter(device: torch.device) -> bool:
    """Tensors on the CPU reach a Triton kernel only under TRITON_INTERPRET=1 (see kernels/backend.py)."""
    return device.type == "cpu"


def dot_precision(dtype: torch.dtype) -> str:
    """float32 models get exact float32 dots; tf32 would miss the 1e-4 accuracy float32 promises."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def _cuda_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device; an H100-sized stand-in under the interpreter."""
    if device.type != "cuda":
        return 132
    return _cuda_multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
