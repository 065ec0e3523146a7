"""Host memory for a CPU engine: the process's malloc tuned for its tensors (glibc only), and the paged KV cache on
2 MiB pages (Linux).

A prefill step allocates and frees activations of several MiB to tens of MiB per op (8192 tokens x the hidden or
MLP width). glibc's malloc hands out such blocks with mmap and returns them with munmap, so every op's output
is fresh memory whose pages fault in one by one on first touch, and the kernel zeroes each: on the bench model,
a 64 x 512-token prefill had about a quarter of its `perf` samples in the kernel, mostly page faults (2026-12-05,
Intel Xeon with AMX, docs/BENCHMARKS.md "AMX prefill attention and the memory the engine reuses"). vLLM's CPU
build has the same need and asks its users to preload TCMalloc. Raising glibc's mmap threshold to its maximum
(32 MiB) and keeping freed memory at the top of the heap (the trim threshold) lets blocks below 32 MiB be reused
from the heap instead; the 64 prompts' prefill ran 1.4x faster (scripts/bench_engine.py). The process keeps its
peak heap instead of returning it between steps. SHARDSERVE_MALLOC_TUNING=0 leaves malloc as it is (for an allocator preloaded instead, or to measure the change).

A decode step reads every running sequence's K/V blocks, which lie anywhere in a layer's cache (256 MiB of it by
default on CPU) once blocks have been freed and reused. On 4 KiB pages nearly every block is a TLB miss; on 2 MiB
pages few are: scattered blocks read 1.3x faster (docs/BENCHMARKS.md, "Decode attention from memory"). Linux ships
transparent huge pages in `madvise` mode on most distributions: a region gets them only when asked, before its
pages are first touched, which is what `zeros_on_huge_pages` does, in a mapping of its own (the heap, which the
malloc settings above keep, could hand back pages already touched). Where they are off (`never`), or on
another OS, the cache is ordinary zeroed memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import sys

import torch

from kernels import switched_on

logger = logging.getLogger("shardserve.kernels")

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest on 64-bit (HEAP_MAX_SIZE / 2); it refuses more
TRIM_THRESHOLD = 2**30  # freed memory kept at the heap's top before it goes back to the OS
TOP_PAD = 64 * 2**20  # heap growth per brk, so a step's activations don't grow it a page at a time


@functools.cache
def reuse_freed_memory() -> bool:
    """Tune glibc's malloc (once per process) so that freed tensor memory up to 32 MiB a block is reused, not
    returned to the OS and faulted in again; False where the C library is not glibc or refuses."""
    if not sys.platform.startswith("linux"):
        return False
    if not switched_on("SHARDSERVE_MALLOC_TUNING"):
        logger.info("malloc left as it is (SHARDSERVE_MALLOC_TUNING=0)")
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    applied = all(mallopt(param, value) == 1 for param, value in settings)
    if not applied:
        logger.warning("mallopt refused the engine's malloc settings; large tensors stay on mmap")
    return applied


HUGE_PAGE = 2 * 2**20


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in memory of its own (an anonymous mapping, untouched whatever the heap holds), advised
    onto 2 MiB pages before it is first written; ordinary zeros where the OS has no such advice or the tensor is
    under one huge page. The mapping lives as long as the tensor (torch.frombuffer holds it)."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE") or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:  # transparent huge pages compiled out of this kernel
        logger.debug("madvise(MADV_HUGEPAGE) refused (%s): the KV cache stays on small pages", exc)
    # written once now, so its pages (huge ones where Linux finds them) are made at start-up: made on first write
    # during steps instead, each cost a fault in the step, and the run went 1.2x slower
    return torch.frombuffer(region, dtype=dtype).view(shape).zero_()
