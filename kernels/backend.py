"""The one entry point the model code calls: picks Triton kernels, native CPU kernels or the torch references.

`auto` runs Triton on CUDA; on CPU, shardserve's native C++ kernels (kernels/cpu_native.py) where
they build, else the plain references. `cpu` insists on the
native kernels; `torch` is the references alone. `triton` on CPU runs the kernels in
Triton's interpreter, which only works when TRITON_INTERPRET=1 was set before the process first
imported triton (the tests do that). Triton is imported only when a Triton backend is asked for, so
CPU users never pay for it. Every op has the signature of its `*_torch` reference.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import cpu_native
from kernels.activation import silu_and_mul_torch
from kernels.attention import paged_decode_attention_torch, paged_prefill_attention_torch
from kernels.bitmask import apply_token_bitmask_torch
from kernels.cache import write_kv_cache_torch
from kernels.linear import no_packing, onednn_packer, small_batch_kernels
from kernels.norm import rms_norm_torch
from kernels.rotary import rotary_embedding_torch
from kernels.sampling import sample_tokens_torch


@dataclass(frozen=True)
class KernelBackend:
    name: str
    write_kv_cache: Callable
    paged_decode_attention: Callable
    paged_prefill_attention: Callable
    rms_norm: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable
    sample_tokens: Callable
    apply_token_bitmask: Callable  # the structured-output mask, in place before sampling (kernels/bitmask.py)
    # (weight [out, in], keep_dense) -> a PackedLinearWeight the linear layers multiply with instead, or None;
    # keep_dense lets it hold the weight as it is too, for a kernel that reads that layout (kernels/linear.py)
    pack_linear_weight: Callable = no_packing


TORCH = KernelBackend(
    name="torch",
    write_kv_cache=write_kv_cache_torch,
    paged_decode_attention=paged_decode_attention_torch,
    paged_prefill_attention=paged_prefill_attention_torch,
    rms_norm=rms_norm_torch,
    rotary_embedding=rotary_embedding_torch,
    silu_and_mul=silu_and_mul_torch,
    sample_tokens=sample_tokens_torch,
    apply_token_bitmask=apply_token_bitmask_torch,
)


@functools.cache
def _triton_backend() -> KernelBackend:
    from kernels.activation_triton import silu_and_mul_triton
    from kernels.bitmask_triton import apply_token_bitmask_triton
    from kernels.cache_triton import write_kv_cache_triton
    from kernels.decode_attention_triton import paged_decode_attention_triton
    from kernels.norm_triton import rms_norm_triton
    from kernels.prefill_attention_triton import paged_prefill_attention_triton
    from kernels.rotary_triton import rotary_embedding_triton
    from kernels.sampling_triton import sample_tokens_triton

    return KernelBackend(
        name="triton",
        write_kv_cache=write_kv_cache_triton,
        paged_decode_attention=paged_decode_attention_triton,
        paged_prefill_attention=paged_prefill_attention_triton,
        rms_norm=rms_norm_triton,
        rotary_embedding=rotary_embedding_triton,
        silu_and_mul=silu_and_mul_triton,
        sample_tokens=sample_tokens_triton,
        apply_token_bitmask=apply_token_bitmask_triton,
    )


NATIVE_DTYPES = (
    torch.float32,
    torch.bfloat16,
)  # what the native CPU kernels take; others go to the references

# The native attention kernels walk a sequence's cache 16 tokens at a time (CPU_KERNEL_BLOCK). A block of 32-256
# tokens is 2-16 such runs, one after the other in the cache: `as_kernel_blocks` hands the kernels the cache as
# blocks of 16 and each table as those runs' numbers, so every block size the engine allows that is a multiple of
# 16 takes the native kernels (vLLM's CPU default is 128; before, such sizes sent prefill to torch's reference: 0.88x
# the throughput in process at concurrency 50, docs/BENCHMARKS.md "KV-cache blocks of 128 tokens on CPU").
CPU_KERNEL_BLOCK = 16


class KernelBlockTables:
    """Tables of 16-token blocks for a step's tables of bigger blocks, made once per table: every layer of a step
    passes the same table tensor, so the last one made is kept, with the table's version (a table written in place
    is made again). Another thread's step only makes its own again."""

    def __init__(self):
        self.last: tuple[torch.Tensor, int, int, torch.Tensor] | None = None

    def __call__(self, block_tables: torch.Tensor, runs: int) -> torch.Tensor:
        last = self.last
        if last is not None and last[0] is block_tables and last[1] == block_tables._version and last[2] == runs:
            return last[3]
        offsets = torch.arange(runs, dtype=torch.int32)
        made = (block_tables.to(torch.int32)[:, :, None] * runs + offsets).reshape(block_tables.shape[0], -1)
        self.last = (block_tables, block_tables._version, runs, made)
        return made


def as_kernel_blocks(kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     tables: KernelBlockTables) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache [2, kv_heads, blocks, block_size, head_dim] and tables in blocks of CPU_KERNEL_BLOCK tokens, where
    block_size is a bigger multiple of it and the cache is contiguous (as the engine allocates it); else as they
    are."""
    block_size = kv_cache.shape[3]
    if block_size <= CPU_KERNEL_BLOCK or block_size % CPU_KERNEL_BLOCK or not kv_cache.is_contiguous():
        return kv_cache, block_tables
    runs = block_size // CPU_KERNEL_BLOCK
    two, kv_heads, blocks, _, head_dim = kv_cache.shape
    return (kv_cache.view(two, kv_heads, blocks * runs, CPU_KERNEL_BLOCK, head_dim),
            tables(block_tables, runs))


@functools.cache
def _native_cpu_backend(target: str, reference_bf16_prefill: bool) -> KernelBackend | None:
    """The native CPU kernels (attention, the KV write, RMSNorm, SiLU-and-mul, rotary, sampling, the grammar mask,
    and in the AVX2 build the small-batch linear product beside oneDNN's packed one) built for `target`
    (kernels/cpu_native.py's ISA_FLAGS), each falling back to its reference for inputs it doesn't take (and, with
    `reference_bf16_prefill`, bfloat16 prefill attention); or None where the extension can't be built."""
    native = cpu_native.load(target)
    if native is None:
        return None

    decode_tables, prefill_tables = KernelBlockTables(), KernelBlockTables()

    def paged_decode_attention(query, kv_cache, block_tables, context_lens, scale):
        if (
            query.dtype in NATIVE_DTYPES
            and block_tables.dtype == torch.int32
            and context_lens.dtype == torch.int32
        ):
            kv_cache, block_tables = as_kernel_blocks(kv_cache, block_tables, decode_tables)
            return native.paged_decode_attention(query, kv_cache, block_tables, context_lens, float(scale))
        return paged_decode_attention_torch(query, kv_cache, block_tables, context_lens, scale)

    def paged_prefill_attention(
        query, kv_cache, block_tables, query_start_loc, context_lens, scale, *, max_query_len=None
    ):
        if block_tables.dtype == torch.int32:
            kv_cache, block_tables = as_kernel_blocks(kv_cache, block_tables, prefill_tables)
        if not (
            query.dtype in NATIVE_DTYPES
            and native.prefill_supported(query.shape[-1], kv_cache.shape[3])
            and block_tables.dtype == query_start_loc.dtype == context_lens.dtype == torch.int32
        ):
            return paged_prefill_attention_torch(
                query, kv_cache, block_tables, query_start_loc, context_lens, scale, max_query_len=max_query_len
            )
        args = (query, kv_cache, block_tables, query_start_loc, context_lens, float(scale))
        if not (reference_bf16_prefill and query.dtype == torch.bfloat16) or (
            max_query_len is not None and max_query_len <= NATIVE_BF16_PREFILL_MAX_QUERY_ON_AMX
        ):
            return native.paged_prefill_attention(*args)
        # long chunks to the reference; short ones (verifications beside a prompt's chunk) stay native, since
        # the reference would pad each of them to the longest chunk
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        short = query_lens <= NATIVE_BF16_PREFILL_MAX_QUERY_ON_AMX
        if not bool(short.any()):
            return paged_prefill_attention_torch(*args[:5], scale, max_query_len=max_query_len)
        out = torch.empty_like(query)
        for part, attention in ((short, native.paged_prefill_attention), (~short, paged_prefill_attention_torch)):
            seqs = part.nonzero().flatten()
            if len(seqs) == 0:
                continue
            lens = query_lens[seqs]
            starts = torch.zeros(len(seqs) + 1, dtype=torch.int32)
            torch.cumsum(lens, 0, out=starts[1:])
            # each chunk's rows of `query`: its start there, plus 0 .. its length - 1
            rows = torch.repeat_interleave(query_start_loc[:-1][seqs] - starts[:-1], lens) + torch.arange(
                int(starts[-1])
            )
            out.index_copy_(0, rows, attention(query.index_select(0, rows), kv_cache, block_tables.index_select(0, seqs),
                                               starts, context_lens.index_select(0, seqs), float(scale)))
        return out

    def rms_norm(x, weight, eps, residual=None):
        if x.dtype in NATIVE_DTYPES and x.dim() == 2 and weight.dtype == x.dtype:
            outs = native.rms_norm(x, weight, eps, residual)
            return outs[0] if residual is None else (outs[0], outs[1])
        return rms_norm_torch(x, weight, eps, residual)

    def silu_and_mul(x):
        if x.dtype in NATIVE_DTYPES and x.dim() == 2:
            return native.silu_and_mul(x)
        return silu_and_mul_torch(x)

    def rotary_embedding(positions, query, key, cos_sin_cache):
        if query.dtype in NATIVE_DTYPES and key.dtype == query.dtype and positions.dtype == torch.int64:
            query, key = native.rotary_embedding(positions, query, key, cos_sin_cache)
            return query, key
        return rotary_embedding_torch(positions, query, key, cos_sin_cache)

    def sample_tokens(logits, temperature, top_k, top_p, min_p, uniforms):
        if logits.dtype == torch.float32:
            return native.sample_tokens(logits, temperature, top_k, top_p, min_p, uniforms)
        return sample_tokens_torch(logits, temperature, top_k, top_p, min_p, uniforms)

    def write_kv_cache(key, value, kv_cache, slot_mapping):
        if (key.dtype == value.dtype == kv_cache.dtype and slot_mapping.dtype == torch.int64
                and kv_cache.is_contiguous()):
            native.write_kv_cache(key, value, kv_cache, slot_mapping)
        else:
            write_kv_cache_torch(key, value, kv_cache, slot_mapping)

    def apply_token_bitmask(logits, bitmask, rows):
        if logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1:
            native.apply_token_bitmask(logits, bitmask.to(torch.int32), rows.to(torch.int64))
        else:
            apply_token_bitmask_torch(logits, bitmask, rows)

    return dataclasses.replace(
        TORCH,
        name="cpu",
        apply_token_bitmask=apply_token_bitmask,
        # the small-batch products (a build with vector code: faster than oneDNN's at a few rows, kernels/linear.py)
        pack_linear_weight=onednn_packer(small_batch_kernels(native) if native.vector_isa() != "scalar" else None,
                                         native.packed_linear_split_rows),
        sample_tokens=sample_tokens,
        write_kv_cache=write_kv_cache,
        paged_decode_attention=paged_decode_attention,
        paged_prefill_attention=paged_prefill_attention,
        rms_norm=rms_norm,
        silu_and_mul=silu_and_mul,
        rotary_embedding=rotary_embedding,
    )


# Chunks of at most this many queries (speculative verifications, short prompt tails) keep the native kernel even
# where reference_bf16_prefill_is_faster: its dense row packing makes a 5-query chunk ~3x faster than the
# reference, which pads and gathers; the two cross between 16 and 32 queries (docs/BENCHMARKS.md, "Speculative
# decoding (n-gram), offline" and the verification row of "Kernels", Intel Xeon with AMX, 2026-12-03). Where the
# native build has its AMX tile kernel (the reference is then never faster), that kernel takes every chunk.
NATIVE_BF16_PREFILL_MAX_QUERY_ON_AMX = 16


@functools.cache
def reference_bf16_prefill_is_faster() -> bool:
    """On an AMX CPU whose native build can't use the tiles (the OS refused them), torch's own attention (oneDNN
    on AMX) runs bfloat16 prefill faster than the native vector loop: 0.6-0.7x its time on the bench model's
    shapes (docs/BENCHMARKS.md, the 2026-12-03 headline, Intel Xeon with AMX). Where the native build has AMX, its
    tile kernel is the faster one (2.4x torch's on a 16 x 512-token step, "AMX prefill attention"); without AMX
    the native vector kernel is (2.5x on the AMD EPYC with avx512_bf16, 2026-11-29, quoted under "Kernels")."""
    if "amx_bf16" not in cpu_native.cpu_flags():
        return False
    native = cpu_native.load()
    return native is None or not native.prefill_amx_available()


@functools.cache
def cpu_supports_bf16() -> bool:
    """AVX512-BF16 or AMX: bfloat16 matrix products run natively on this CPU (else float32 is faster)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_native.cpu_flags())


def triton_interpreter_enabled() -> bool:
    """Triton's own switch for running kernels on the CPU (read by triton at import time)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on")  # as triton parses it


def get_backend(name: str = "auto", device_type: str = "cpu") -> KernelBackend:
    """`auto`: Triton on CUDA, native (else torch) on CPU. `cpu`: the native CPU kernels.
    `triton`: CUDA, or CPU under TRITON_INTERPRET=1. `torch`: the references."""
    if name == "torch":
        return TORCH
    if name == "auto":
        if device_type == "cuda":
            return _triton_backend()
        return (engine_cpu_backend(cpu_native.isa()) or TORCH) if device_type == "cpu" else TORCH
    if name == "cpu":
        native = engine_cpu_backend(cpu_native.isa()) if device_type == "cpu" else None
        if native is None:
            raise ValueError(
                f"kernel backend 'cpu' needs a CPU device and the native kernels built (device {device_type!r}; "
                "see kernels/cpu_native.py: a C++ compiler, ninja, SHARDSERVE_CPU_KERNELS not 0)"
            )
        return native
    if name == "triton":
        if device_type == "cuda" or (device_type == "cpu" and triton_interpreter_enabled()):
            return _triton_backend()
        raise ValueError(
            f"kernel backend 'triton' needs a CUDA device (got {device_type!r}); on CPU set TRITON_INTERPRET=1 "
            "before starting Python to run the kernels in Triton's interpreter, or use 'torch' or 'auto'"
        )
    raise ValueError(f"unknown kernel backend {name!r}: choose 'auto', 'cpu', 'torch' or 'triton'")


def engine_cpu_backend(target: str) -> KernelBackend | None:
    """The `cpu` backend an engine gets for `target`'s build: native ops, with bfloat16 prefill attention left to
    the reference where that is faster on this CPU (reference_bf16_prefill_is_faster); None where it can't be
    built."""
    return _native_cpu_backend(target, reference_bf16_prefill_is_faster())


def native_cpu_backend(target: str) -> KernelBackend:
    """The `cpu` backend built for `target` ("native" or "avx2", kernels/cpu_native.py) whatever
    SHARDSERVE_CPU_ISA says, with every op native where it can be: the tests run it for each of
    cpu_native.runnable_isas()."""
    native = _native_cpu_backend(target, reference_bf16_prefill=False)
    if native is None:
        raise ValueError(f"the native CPU kernels for {target!r} are not built (see kernels/cpu_native.py)")
    return native
