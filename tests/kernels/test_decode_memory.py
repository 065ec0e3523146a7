"""The KV cache on huge pages (kernels/host_memory.py) and the benchmark of decode attention from memory."""

import re
import sys
from pathlib import Path

import pytest
import torch

from kernels.host_memory import HUGE_PAGE, reuse_freed_memory, zeros_on_huge_pages


def huge_page_bytes_backing(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings that overlap the tensor's memory (/proc/self/smaps; madvise splits a mapping
    where the advised range begins and ends)."""
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    overlaps, huge = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            overlaps = int(span[1], 16) < end and start < int(span[2], 16)
        elif overlaps and line.startswith("AnonHugePages:"):
            huge += int(line.split()[1]) * 1024
    return huge


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages: Linux only")
def test_the_kv_cache_is_zeroed_and_on_huge_pages_where_linux_gives_them():
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    enabled = mode.exists() and "[never]" not in mode.read_text()
    # whatever the heap holds (the engine's malloc settings keep freed memory): this test's process may have
    # built engines before, and the cache must still be fresh memory
    reuse_freed_memory()
    held = [torch.ones(24 * 2**20 // 4) for _ in range(10)]  # 240 MiB the heap keeps once freed
    del held
    cache = zeros_on_huge_pages((2, 4, 4096, 16, 64), torch.bfloat16)  # 64 MiB
    assert cache.shape == (2, 4, 4096, 16, 64) and cache.dtype == torch.bfloat16
    assert not cache.any()
    cache.fill_(1.0)  # the pages are made on first write
    assert int(cache.float().sum()) == cache.numel()
    backed = huge_page_bytes_backing(cache)
    if enabled:
        # the whole 2 MiB pages inside the tensor: all but the partial ones at its two ends
        assert backed >= 64 * 2**20 - 2 * HUGE_PAGE, backed
    else:
        assert backed == 0


def test_block_layouts_hold_each_sequence_s_blocks_once_in_the_order_named():
    from scripts.bench_decode_memory import block_tables

    generator = torch.Generator().manual_seed(0)
    together, descending, scattered = (block_tables(256, 4, 40, layout, generator)
                                       for layout in ("together", "descending", "scattered"))
    assert together.shape == descending.shape == scattered.shape == (4, 3)
    assert ((together[:, 1:] - together[:, :-1]) == 1).all()
    assert ((descending[:, 1:] - descending[:, :-1]) == -1).all()
    assert len(set(scattered.flatten().tolist())) == 12


def test_the_decode_memory_benchmark_times_each_page_size_and_block_layout(capsys):
    from scripts.bench_decode_memory import main

    main(["--batch", "4", "--context", "40", "--repeats", "1", "--layer-mib", "4"])
    # the table at the end (each row is also printed as it is measured)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "ms" not in line][-6:]
    assert [tuple(cell.strip() for cell in row.split("|")[1:3]) for row in rows] == [
        (pages, layout) for pages in ("4 KiB", "2 MiB") for layout in ("together", "descending", "scattered")]
    assert all(float(row.split("|")[3]) > 0 for row in rows)
