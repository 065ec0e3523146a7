"""Decode attention with the K/V read from memory, not the CPU's cache (part of `make bench`).

    python -m scripts.bench_decode_memory [--write-doc]

scripts/bench_cpu_kernels.py times decode attention on a cache small enough to stay in the CPU's last-level cache
between calls; a serving engine's step reads each layer's blocks once, from memory. Here: the bench model's shapes
(8 query / 4 KV heads, head_dim 64, bfloat16), 8 layers' caches of 256 MiB each (the CPU default's 2 GiB), a
batch of --batch sequences of --context tokens, and one "step" runs the native kernel over the 8 layers in turn.
Each sequence's blocks lie together (as a fresh engine allocates a prompt's), together but last first (as the free
queue hands back a finished sequence's blocks, which the block manager now sorts), or scattered over the cache (as
blocks freed and reused one at a time end up), and the caches are on 4 KiB pages or on 2 MiB
pages (kernels/host_memory.py, as the engine allocates them). Prints ms per layer (median of --repeats steps)
and the K/V read rate, beside the rate a torch sum reads 256 MiB at.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch

from kernels.backend import get_backend
from kernels.host_memory import zeros_on_huge_pages
from scripts.doc_blocks import cpu_description, rewrite_block

BEGIN, END = "<!-- decode-memory:begin -->", "<!-- decode-memory:end -->"
LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 8, 4, 64, 16
LAYER_BYTES = 256 * 2**20


def caches(huge: bool, layer_bytes: int, generator: torch.Generator) -> list[torch.Tensor]:
    num_blocks = layer_bytes // (2 * KV_HEADS * BLOCK * HEAD_DIM * 2)
    shape = (2, KV_HEADS, num_blocks, BLOCK, HEAD_DIM)
    made = []
    for _ in range(LAYERS):
        cache = zeros_on_huge_pages(shape, torch.bfloat16) if huge else torch.zeros(shape, dtype=torch.bfloat16)
        made.append(cache.normal_(generator=generator))
    return made


LAYOUTS = ("together", "descending", "scattered")


def block_tables(num_blocks: int, batch: int, context: int, layout: str, generator) -> torch.Tensor:
    """Each sequence's blocks: `together` (ascending and adjacent, as a fresh engine allocates a prompt's),
    `descending` (adjacent, last first: a prompt's blocks as the free queue returned a finished sequence's, tail
    first, before the block manager sorted them) or `scattered` (anywhere, as blocks freed and reused one at a time)."""
    per = -(-context // BLOCK)
    if layout == "scattered":
        return torch.randperm(num_blocks, generator=generator)[: batch * per].view(batch, per).to(torch.int32)
    starts = torch.randperm(num_blocks // per, generator=generator)[:batch] * per
    offsets = torch.arange(per) if layout == "together" else torch.arange(per - 1, -1, -1)
    return (starts[:, None] + offsets[None, :]).to(torch.int32)


def sum_rate() -> float:
    """GB/s a torch sum reads 256 MiB at (what the memory gives two threads here)."""
    x = torch.ones(LAYER_BYTES // 8, dtype=torch.int64)
    x.sum()
    start = time.perf_counter()
    for _ in range(5):
        x.sum()
    return LAYER_BYTES * 5 / (time.perf_counter() - start) / 1e9


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=96)
    parser.add_argument("--context", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layer-mib", type=int, default=LAYER_BYTES // 2**20, help="each layer's cache")
    parser.add_argument("--write-doc", action="store_true")
    args = parser.parse_args(argv)
    native = get_backend("cpu", "cpu")
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(args.batch, HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    kv_bytes = args.batch * args.context * KV_HEADS * HEAD_DIM * 2 * 2
    rows = []
    for huge in (False, True):
        layers = caches(huge, args.layer_mib * 2**20, generator)
        for layout in LAYOUTS:
            tables = block_tables(layers[0].shape[2], args.batch, args.context, layout, generator)

            def step(layers=layers, tables=tables):
                return [native.paged_decode_attention(query, cache, tables, lens, 0.125) for cache in layers]

            step()
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                step()
                times.append((time.perf_counter() - start) / LAYERS)
            ms = statistics.median(times) * 1e3
            rows.append(f"| {'2 MiB' if huge else '4 KiB'} | {layout} | "
                        f"{ms:.2f} | {kv_bytes / ms / 1e6:.1f} |")
            print(rows[-1], flush=True)
        del layers
    lines = [
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_description()}, "
        f"{torch.get_num_threads()} torch threads: decode attention (native) over 8 layers' "
        f"{args.layer_mib} MiB bfloat16 caches, batch {args.batch} × context {args.context}, median of {args.repeats} steps. "
        f"A torch sum reads 256 MiB at {sum_rate():.1f} GB/s here.",
        "",
        "| pages | each sequence's blocks | ms per layer | K/V read GB/s |",
        "|---|---|---|---|",
        *rows,
        "",
        "Command: `python -m scripts.bench_decode_memory --write-doc` (in `make bench`)",
    ]
    print("\n".join(lines))
    if args.write_doc:
        rewrite_block(BEGIN, END, "\n".join(lines), "Decode attention from memory")


if __name__ == "__main__":
    main()
