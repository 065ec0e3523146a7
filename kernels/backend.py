"""The one entry point the model code calls: picks Triton kernels or the torch references.

`auto` runs Triton on CUDA and the torch references on CPU. `triton` on CPU runs the kernels in
Triton's interpreter, which only works when TRITON_INTERPRET=1 was set before the process first
imported triton (the tests do that). Triton is imported only when a Triton backend is asked for, so
CPU users never pay for it. Every op has the signature of its `*_torch` reference.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

from kernels.activation import silu_and_mul_torch
from kernels.attention import paged_decode_attention_torch, paged_prefill_attention_torch
from kernels.cache import write_kv_cache_torch
from kernels.norm import rms_norm_torch
from kernels.rotary import rotary_embedding_torch


@dataclass(frozen=True)
class KernelBackend:
    name: str
    write_kv_cache: Callable
    paged_decode_attention: Callable
    paged_prefill_attention: Callable
    rms_norm: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable


TORCH = KernelBackend(
    name="torch",
    write_kv_cache=write_kv_cache_torch,
    paged_decode_attention=paged_decode_attention_torch,
    paged_prefill_attention=paged_prefill_attention_torch,
    rms_norm=rms_norm_torch,
    rotary_embedding=rotary_embedding_torch,
    silu_and_mul=silu_and_mul_torch,
)


@functools.cache
def _triton_backend() -> KernelBackend:
    from kernels.activation_triton import silu_and_mul_triton
    from kernels.cache_triton import write_kv_cache_triton
    from kernels.decode_attention_triton import paged_decode_attention_triton
    from kernels.norm_triton import rms_norm_triton
    from kernels.prefill_attention_triton import paged_prefill_attention_triton
    from kernels.rotary_triton import rotary_embedding_triton

    return KernelBackend(
        name="triton",
        write_kv_cache=write_kv_cache_triton,
        paged_decode_attention=paged_decode_attention_triton,
        paged_prefill_attention=paged_prefill_attention_triton,
        rms_norm=rms_norm_triton,
        rotary_embedding=rotary_embedding_triton,
        silu_and_mul=silu_and_mul_triton,
    )


def triton_interpreter_enabled() -> bool:
    """Triton's own switch for running kernels on the CPU (read by triton at import time)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on")  # as triton parses it


def get_backend(name: str = "auto", device_type: str = "cpu") -> KernelBackend:
    """`auto`: Triton on CUDA, torch on CPU. `triton`: CUDA, or CPU under TRITON_INTERPRET=1. `torch`: references."""
    if name == "torch":
        return TORCH
    if name == "auto":
        return _triton_backend() if device_type == "cuda" else TORCH
    if name == "triton":
        if device_type == "cuda" or (device_type == "cpu" and triton_interpreter_enabled()):
            return _triton_backend()
        raise ValueError(
            f"kernel backend 'triton' needs a CUDA device (got {device_type!r}); on CPU set TRITON_INTERPRET=1 "
            "before starting Python to run the kernels in Triton's interpreter, or use 'torch' or 'auto'"
        )
    raise ValueError(f"unknown kernel backend {name!r}: choose 'auto', 'torch' or 'triton'")
