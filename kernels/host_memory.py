"""Host memory for a CPU engine: the process's malloc tuned for its tensors (glibc only), and the paged KV cache on
2 MiB pages (Linux).

A prefill step allocates and frees activations of several MiB to tens of MiB per op (8192 tokens x the hidden or
MLP width). glibc's malloc hands out such blocks with mmap and returns them with munmap, so every op's output
is fresh memory whose pages fault in one by one on first touch, and the kernel zeroes each: on the bench model,
a 64 x 512-token prefill spent about a third of its time in page faults (2026-12-05, Intel Xeon with AMX,
docs/BENCHMARKS.md "Memory the engine reuses"). vLLM's CPU build has the same need and asks its users to
preload TCMalloc. Raising glibc's mmap threshold to its maximum (32 MiB) and keeping freed memory at the top of
the heap (the trim threshold) lets every block below 32 MiB be reused from the heap instead; the same prefill
ran 1.45x faster. The process keeps its peak heap instead of returning it between steps.
SHARDSERVE_MALLOC_TUNING=0 leaves malloc as it is (for an allocator preloaded instead, or to measure the change).

A decode step reads every running sequence's K/V blocks, which lie anywhere in a layer's cache (256 MiB of it by
default on CPU) once blocks have been freed and reused. On 4 KiB pages nearly every block is a TLB miss; on 2 MiB
pages few are: scattered blocks read 1.4x faster (docs/BENCHMARKS.md, "Decode attention from memory"). Linux ships
transparent huge pages in `madvise` mode on most distributions: a region gets them only when asked, before its
pages are first touched, which is what `zeros_on_huge_pages` does. Where they are off (`never`), or on another
OS, the cache is an ordinary zeroed tensor.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

import torch

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
    if os.environ.get("SHARDSERVE_MALLOC_TUNING", "1").lower() in ("0", "false", "off", "no"):
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


MADV_HUGEPAGE = 14  # linux/mman.h
PAGE = 4096
HUGE_PAGE = 2 * 2**20


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back the whole pages inside `tensor`'s memory with 2 MiB pages; True if it took the advice.
    Pages already touched keep their size until the kernel's khugepaged merges them."""
    nbytes = tensor.untyped_storage().nbytes()
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu" or nbytes < HUGE_PAGE:
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    address = tensor.untyped_storage().data_ptr()
    start = -(-address // PAGE) * PAGE
    length = (address + nbytes - start) // PAGE * PAGE
    if libc.madvise(start, length, MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused (errno %d): the KV cache stays on small pages", ctypes.get_errno())
        return False
    return True


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor, on huge pages where Linux gives them (advised before the zeroing first touches it)."""
    tensor = torch.empty(shape, dtype=dtype)
    advise_huge_pages(tensor)
    return tensor.zero_()
