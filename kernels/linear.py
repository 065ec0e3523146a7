"""A linear layer's matrix product, x W^T (+ bias): torch's F.linear, or oneDNN's on a weight packed once, or
for a few rows of activations the native small-batch product on the weight as it is.

Unpacked, each F.linear call on CPU reorders the weight into oneDNN's blocked layout before it multiplies; packed
once at load, a bench-model decode step's matrix products run 1.3-1.7x faster at batch 1-50 (docs/BENCHMARKS.md,
"Kernels"). Its bfloat16 results are bit-identical to F.linear's; float32's differ in the last bits (another
summation order), as the native kernels' do in both dtypes. At a decode step's few rows a product reads the whole
weight: oneDNN's reads it at about half the rate two cores stream memory, the native kernels
(kernels/cpu/linear.cpp) near the full rate: the vector product on the weight as it is, 1.5x faster at batch 1 on
the AVX2 EPYC (float32; docs/BENCHMARKS.md, "On the AVX2 EPYC"), and on CPUs with AMX the tile product on the
weight laid out as tiles, which reads it once at any row count: 0.66-0.84x oneDNN's time at 1-64 rows, 0.91-0.94x
at 80-96 (bfloat16, up to 96 rows; "Linears at batch 1-128: the native products on a second copy of the
weight"). Each needs the weight in its own layout, so a layer holds two copies where memory allows (the model
runner decides); the LM head always holds its dense weight (a tied embedding shares it). A packed product of more
than 256 rows runs on a row-count bucket, zero-padded (`padded_rows`), so that oneDNN builds a primitive per bucket
and not per step size. Where oneDNN's own split of a bucket's product over the threads leaves one of them idle, the
product runs on the rows cut into one part per thread instead (`SplitRowsChoice`). The kernel backend chooses the
packer (kernels/backend.py); the parallel layers only hold what it returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import switched_on

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Rows of activations up to which the native small-batch product beats oneDNN's packed one, by weight dtype: float32
# crosses between 8 and 16 rows (the AVX2 EPYC, docs/BENCHMARKS.md "On the AVX2 EPYC"; on the Intel Xeon with AMX
# 0.75-0.79x oneDNN's time up to 8), bfloat16 between 4 and 6 (the vector product runs it where the CPU has no AMX;
# on the Intel Xeon with AMX 0.72x at 1 row, 0.89x at 4, 1.06x at 6: docs/BENCHMARKS.md "Linears at batch 1-128: the
# native products on a second copy of the weight")
SMALL_BATCH_MAX_ROWS = {torch.float32: 8, torch.bfloat16: 4}
# Rows up to which bfloat16 products run on AMX tiles where the CPU has them: the tile product reads the weight from
# memory once at any row count, but its tile multiplies add up past ~64 rows: on the Intel Xeon with AMX a whole
# decode step's products took 0.66-0.84x oneDNN's time at 1-64 rows, 0.91-0.94x at 80-96 and 1.04-1.06x at 128
# (docs/BENCHMARKS.md, "Linears at batch 1-128 ..."); decode batches of up to 96 sequences, and prefills of short
# prompts, run on it
AMX_SMALL_BATCH_MAX_ROWS = 96


@dataclass(frozen=True)
class SmallBatchKernel:
    """A native product for a few rows of activations, on a second copy of the weight in the layout it reads."""

    layout: Callable[[torch.Tensor], torch.Tensor]  # the weight [out, in] -> the copy the kernel reads
    product: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]  # (x, copy, bias, out)
    max_rows: int
    shares_weight: bool  # the "copy" is the weight itself (no memory of its own where the weight stays)


def small_batch_kernels(native) -> dict[torch.dtype, SmallBatchKernel]:
    """The native build's small-batch products by weight dtype: the vector product on the weight as it is (float32,
    and bfloat16 where the CPU has no AMX), the AMX tile product on the weight laid out as tiles (bfloat16)."""
    def vector(dtype: torch.dtype) -> SmallBatchKernel:
        return SmallBatchKernel(lambda weight: weight.detach(), lambda x, dense, bias, out: native.small_batch_linear(
            x, dense, bias), SMALL_BATCH_MAX_ROWS[dtype], shares_weight=True)

    kernels = {dtype: vector(dtype) for dtype in SMALL_BATCH_MAX_ROWS}
    if native.amx_linear_available():
        kernels[torch.bfloat16] = SmallBatchKernel(native.amx_weight_tiles, lambda x, tiles, bias, out: (
            native.amx_small_batch_linear(x, tiles, out, bias)), AMX_SMALL_BATCH_MAX_ROWS, shares_weight=False)
    return kernels


# Row counts up to which oneDNN's packed product runs on the rows as they are (see padded_rows)
EXACT_ROWS_MAX = 256
# SHARDSERVE_LINEAR_ROW_BUCKETS=0: every product on its rows as they are (to measure what the buckets do)
ROW_BUCKETS = switched_on("SHARDSERVE_LINEAR_ROW_BUCKETS")
# SHARDSERVE_LINEAR_SPLIT_ROWS=0: never cut a product's rows over the threads (to measure what SplitRowsChoice does)
SPLIT_ROWS = switched_on("SHARDSERVE_LINEAR_SPLIT_ROWS")
# Row buckets whose products may run cut over the threads: above 1280 rows oneDNN's own split kept both threads busy
# on every shape measured, and each bucket decided costs its first product a few more runs (a cold server's first
# steps of 1-2K tokens paid that: docs/BENCHMARKS.md, "Linears: oneDNN's split over two threads")
SPLIT_ROWS_MAX = 1280


def padded_rows(rows: int) -> int:
    """The rows a packed product of `rows` activation rows runs on: `rows` itself up to EXACT_ROWS_MAX; above it,
    the next multiple of 1/32 of the power of two at or above `rows` (300 -> 304, 500 -> 512, 513 -> 544, 2000 ->
    2048): at most 1/16 more rows, 2% on average, and 16 row counts per doubling.

    oneDNN builds (JIT-compiles) a matmul primitive for each row count it meets and keeps 1,024 of them. Building
    one costs several times the product it is built for (bfloat16 on AMX, a 1536 x 512 weight: 500 rows 4.8 ms
    the first time and 0.4-1.3 ms after, 2000 rows 14.5 ms and 1.7 ms), and a served step's row count (its
    decodes plus the prompt chunks that fit its token budget) is often one it has not met. Padded with zero rows
    whose results are dropped, a step's products run on 16 row counts per doubling instead: prompts of 256-768
    tokens, each of a length not met before, reach their first token in 43-44 ms instead of 52-55 on the bench model
    (docs/BENCHMARKS.md, "oneDNN's primitive per row count"). Up to EXACT_ROWS_MAX (decode batches, whose products read the weight more than
    they compute) the rows stay as they are: 50 rows padded to 64 cost 5-15% there. A row's result does not
    depend on the other rows of the product."""
    if rows <= EXACT_ROWS_MAX or not ROW_BUCKETS:
        return rows
    step = 1 << ((rows - 1).bit_length() - 5)
    return -(-rows // step) * step


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product of `x` and a weight in its packed layout."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class SplitRowsChoice:
    """For each (weight shape, dtype, row bucket): whether a bfloat16 product runs faster as oneDNN runs it or with
    its rows cut into one part per thread, each part's product on its thread alone (the native
    packed_linear_split_rows). oneDNN splits a product over the threads by its own rule, and with 2 threads that
    rule leaves one idle for some shapes and row counts: on the Intel Xeon with AMX, bfloat16, 384-1280 rows of a
    1536 -> 576 product, 768-1024 of 576 -> 960 and 384-768 of 576 -> 576 took as long on 1 thread as on 2, and cut
    in two they ran 1.5-2.0x faster; where oneDNN keeps both busy, the cut ran 0.5-0.9x (docs/BENCHMARKS.md,
    "Linears: oneDNN's split over two threads"). So the first product of a shape at a bucket times both, twice,
    alternated, and the faster (the cut only where it wins by a margin) runs every later one. Only the buckets above
    EXACT_ROWS_MAX and up to SPLIT_ROWS_MAX: they are a bounded set (16 per doubling), and each is decided once for
    all the layers that share the shape. The two differ at most in the last bit of a few outputs (oneDNN blocks a
    product of other rows differently)."""

    MARGIN = 1.15  # the cut runs only where it took at most 1/MARGIN of oneDNN's time

    def __init__(self, split: Callable):
        self.split = split
        self.choices: dict[tuple, bool] = {}

    def matmul(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        key = (tuple(packed.shape), x.dtype, x.shape[0])
        choice = self.choices.get(key)
        if choice is None:
            return self._decide(key, x, packed, bias)
        return self.split(x, packed, bias) if choice else onednn_linear(x, packed, bias)

    def _decide(self, key: tuple, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        runs = {False: lambda: onednn_linear(x, packed, bias), True: lambda: self.split(x, packed, bias)}
        best = {False: float("inf"), True: float("inf")}
        for run in runs.values():
            out = run()  # each builds its oneDNN primitives first
        for _ in range(2):
            for cut, run in runs.items():
                start = time.perf_counter()
                out = run()
                best[cut] = min(best[cut], time.perf_counter() - start)
        self.choices[key] = choice = best[True] * self.MARGIN <= best[False]
        return out if choice else runs[False]()


class PackedLinearWeight:
    """A [out, in] CPU weight in oneDNN's blocked layout; with `small_batch` (a native kernel for its dtype) also a
    second copy in the layout that kernel reads, for products of at most its max_rows rows."""

    def __init__(self, weight: torch.Tensor, small_batch: SmallBatchKernel | None = None,
                 split_rows: SplitRowsChoice | None = None):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.small_batch = small_batch
        self.out_features = weight.shape[0]
        self.split_rows = split_rows if weight.dtype == torch.bfloat16 and SPLIT_ROWS else None
        # keeps the weight's storage (or its tiles) when the layer drops it
        self.dense = small_batch.layout(weight) if small_batch is not None else None

    @property
    def nbytes(self) -> int:
        """The packed copy's bytes: what stands in for the weight (parallel.layers.weight_bytes)."""
        return self.packed.numel() * self.packed.element_size()

    @property
    def dense_copy_bytes(self) -> int:
        """The bytes of the second copy held beside the packed one for the small-batch kernel (0: none)."""
        return self.dense.numel() * self.dense.element_size() if self.dense is not None else 0

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [n, in] -> [n, out]
        if self.small_batch is not None and x.shape[0] <= self.small_batch.max_rows and x.dtype == self.dense.dtype:
            return self.small_batch.product(x, self.dense, bias, self.out_features)
        rows = x.shape[0]
        padded = padded_rows(rows)
        product = onednn_linear
        if self.split_rows is not None and EXACT_ROWS_MAX < padded <= SPLIT_ROWS_MAX:
            product = self.split_rows.matmul
        if padded == rows:
            return product(x.contiguous(), self.packed, bias)
        padded_x = x.new_empty((padded, x.shape[1]))
        padded_x[:rows].copy_(x)
        padded_x[rows:].zero_()
        return product(padded_x, self.packed, bias)[:rows]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedLinearWeight | None) -> torch.Tensor:
    """x W^T (+ bias) with the packed copy where there is one."""
    if packed is not None:
        return packed.matmul(x, bias)
    return F.linear(x, weight, bias)


def no_packing(weight: torch.Tensor, keep_dense: bool = False, weight_stays: bool = False) -> None:
    """The torch and Triton backends multiply the weight as it is."""
    return None


def onednn_packer(small_batch: dict[torch.dtype, SmallBatchKernel] | None = None,
                  split_rows: Callable | None = None) -> Callable[..., PackedLinearWeight | None]:
    """The native CPU backend's packer; `small_batch`: the native small-batch products by weight dtype, for the
    weights the caller lets them keep a second copy of (`keep_dense`), or whose dense weight stays anyway
    (`weight_stays`: the LM head, which a tied embedding shares) where the kernel reads that weight itself;
    `split_rows`: the native product with the rows cut over the threads, for the bfloat16 buckets where it is faster
    (SplitRowsChoice, one per packer: its choices hold for the shapes it packs)."""
    choice = SplitRowsChoice(split_rows) if split_rows is not None else None
    kernels = small_batch or {}

    def pack(weight: torch.Tensor, keep_dense: bool = False, weight_stays: bool = False) -> PackedLinearWeight | None:
        """A CPU float32 or bfloat16 weight, packed; anything else as it is, and so is a bfloat16 weight on a CPU
        whose oneDNN cannot pack one (it needs AVX-512 or AVX-NE-CONVERT; on AVX2 alone its reorder raises, and
        F.linear still multiplies bfloat16)."""
        if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES:
            return None
        try:
            kernel = kernels.get(weight.dtype)
            if kernel is not None and not keep_dense and not (weight_stays and kernel.shares_weight):
                kernel = None
            return PackedLinearWeight(weight, kernel, choice)
        except RuntimeError:
            if weight.dtype != torch.bfloat16:
                raise
            return None

    return pack


pack_for_onednn = onednn_packer()  # oneDNN's layout alone
