"""Compile the Triton kernels for a GPU that is not here (sm_90, Hopper), from launches recorded on meta
tensors (kernels/triton_variants.py), and read each cubin's registers, spills and shared memory with the
cuobjdump that Triton's wheel bundles. Needs the real compiler: TRITON_INTERPRET must be unset.

`hopper_matrix()` is the set of variants the models we serve reach: head_dim 64 and 128, query heads per
KV head 1 to 16, float16 and bfloat16, split-K's every BLOCK_S, the vocabularies of Llama 3 (128,256),
Qwen2.5 (151,936), Llama 2 (32,000) and SmolLM2 (49,152).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.triton_variants import TritonLaunch, constexpr_names, distinct_variants, record_launches

META = torch.device("meta")
HOPPER = ("cuda", 90, 32)
HOPPER_SHARED_BYTES = 227 * 1024
HEAD_DIMS = (64, 128)
GROUPS = (1, 2, 4, 8, 16)
DTYPES = (torch.float16, torch.bfloat16)
VOCABS = (32000, 49152, 128256, 151936)
SPLITS = (2, 4, 8, 16, 32, 64)  # split-K partitions: BLOCK_S of the merge kernel
_USAGE = re.compile(r"Function (\w+):\s+REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


@dataclass(frozen=True)
class CompiledVariant:
    """One variant built for the target, and what its cubin uses per thread and per block."""

    launch: TritonLaunch
    registers: int
    stack_bytes: int
    local_bytes: int  # per-thread local memory: register spills (and stack arrays)
    shared_bytes: int

    @property
    def spills(self) -> bool:
        return self.local_bytes > 0 or self.stack_bytes > 0


def _specialisation(launch: TritonLaunch):
    """The (signature, constexprs, attrs) Triton's launcher would derive from these arguments."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    declared = constexpr_names(launch.kernel)
    signature, constexprs, attrs = {}, {}, {}
    for index, (name, value) in enumerate(launch.arguments):
        if name in declared:
            signature[name], constexprs[(index,)] = "constexpr", value
            continue
        kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[name] = kind
        if kind == "constexpr":  # an integer equal to 1 is compiled in as a constant
            constexprs[(index,)] = key
        elif isinstance(key, str):
            attrs[(index,)] = BaseBackend.parse_attr(key)
    return signature, constexprs, attrs


def cuobjdump() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def compile_variant(launch: TritonLaunch, target: tuple = HOPPER) -> CompiledVariant:
    """Build one recorded launch for `target` (backend, arch, warp size) and read its cubin's resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(launch.kernel, JITFunction):
        raise RuntimeError("compiling for a GPU needs the real Triton compiler: unset TRITON_INTERPRET")
    signature, constexprs, attrs = _specialisation(launch)
    source = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget(*target), options=dict(launch.options))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(cuobjdump()), "-res-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
    match = _USAGE.search(usage)
    if match is None:
        raise RuntimeError(f"cuobjdump gave no resource usage for {launch.name}:\n{usage}")
    registers, stack, _, local = (int(match.group(i)) for i in range(2, 6))
    return CompiledVariant(launch, registers, stack, local, compiled.metadata.shared)


def _tensor(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device=META)


def _attention(ops, head_dim: int, group: int, dtype) -> None:
    """Decode (one partition and split-K), prefill, the KV write and rotary for one head layout."""
    kv_heads = 8 if group <= 4 else 2
    heads = kv_heads * group
    query, key = _tensor(4, heads, head_dim, dtype=dtype), _tensor(4, kv_heads, head_dim, dtype=dtype)
    cache = _tensor(2, kv_heads, 256, 16, head_dim, dtype=dtype)
    tables, lens = _tensor(4, 8, dtype=torch.int32), _tensor(4, dtype=torch.int32)
    ops.paged_decode_attention(query, cache, tables, lens, 0.1, num_splits=1)
    ops.paged_decode_attention(query, cache, tables, lens, 0.1, num_splits=2)
    starts = _tensor(5, dtype=torch.int32)
    ops.paged_prefill_attention(query, cache, tables, starts, lens, 0.1, max_query_len=1)
    ops.write_kv_cache(key, key, cache, _tensor(4, dtype=torch.int64))
    ops.rotary_embedding(_tensor(4, dtype=torch.int64), query, key, _tensor(8192, head_dim))


def _merges(ops, head_dim: int, dtype, splits=SPLITS) -> None:
    """Split-K with each partition count: the merge kernel's every BLOCK_S."""
    for num_splits in splits:
        query, cache = _tensor(1, 8, head_dim, dtype=dtype), _tensor(2, 8, 16 * num_splits * 4, 16, head_dim, dtype=dtype)
        tables = _tensor(1, 4 * num_splits, dtype=torch.int32)
        ops.paged_decode_attention(query, cache, tables, _tensor(1, dtype=torch.int32), 0.1, num_splits=num_splits)


def _pointwise(ops, dtype, hidden: int, intermediate: int) -> None:
    """RMSNorm (with and without the residual) and SiLU-and-mul at one model's widths."""
    x = _tensor(4, hidden, dtype=dtype)
    ops.rms_norm(x, _tensor(hidden, dtype=dtype), 1e-5)
    ops.rms_norm(x, _tensor(hidden, dtype=dtype), 1e-5, residual=x)
    ops.silu_and_mul(_tensor(4, 2 * intermediate, dtype=dtype))


def _sampling(ops, vocab: int) -> None:
    """The fused sampler and the grammar mask over one vocabulary (float32 logits whatever the model's dtype)."""
    rows = _tensor(4)
    ops.sample_tokens(_tensor(4, vocab), rows, _tensor(4, dtype=torch.int32), rows, rows, _tensor(4, dtype=torch.float64))
    words = -(-vocab // 32)
    ops.apply_token_bitmask(_tensor(4, vocab), _tensor(4, words, dtype=torch.int32), _tensor(4, dtype=torch.int64))


def record_variants(calls: list[Callable]) -> list[TritonLaunch]:
    """The distinct variants the calls launch (each call gets the Triton backend's ops)."""
    from kernels.backend import get_backend

    ops = get_backend("triton", "cuda")
    with record_launches() as launches:
        for call in calls:
            call(ops)
    return list(distinct_variants(launches).values())


def hopper_matrix() -> list[TritonLaunch]:
    """Every variant of the models we serve (see the module docstring): about 150."""
    calls: list[Callable] = []
    for dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            calls += [lambda ops, d=head_dim, g=group, t=dtype: _attention(ops, d, g, t) for group in GROUPS]
            calls.append(lambda ops, d=head_dim, t=dtype: _merges(ops, d, t))
        for hidden, intermediate in ((4096, 14336), (3584, 18944), (576, 1536), (128, 128)):
            calls.append(lambda ops, h=hidden, i=intermediate, t=dtype: _pointwise(ops, t, h, i))
    calls += [lambda ops, v=vocab: _sampling(ops, v) for vocab in VOCABS]
    return record_variants(calls)


def quick_matrix() -> list[TritonLaunch]:
    """A few variants of each kernel, the heaviest shapes first (for the test suite)."""
    return record_variants([
        lambda ops: _attention(ops, 128, 4, torch.bfloat16),
        lambda ops: _attention(ops, 64, 16, torch.float16),
        lambda ops: _merges(ops, 128, torch.bfloat16, splits=(64,)),
        lambda ops: _pointwise(ops, torch.bfloat16, 4096, 14336),
        lambda ops: _sampling(ops, 151936),
    ])


def check_variant(variant: CompiledVariant) -> str | None:
    """What is wrong with a compiled variant for Hopper, or None."""
    if variant.spills:
        return f"{variant.launch.describe()} spills: {variant.local_bytes} B local, {variant.stack_bytes} B stack"
    if variant.shared_bytes > HOPPER_SHARED_BYTES:
        return f"{variant.launch.describe()} needs {variant.shared_bytes} B of shared memory, over Hopper's 227 KiB"
    return None
