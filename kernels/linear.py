"""A linear layer's matrix product, x W^T (+ bias): torch's F.linear, or oneDNN's on a weight packed once, or
for a few rows of float32 activations the native small-batch product on the weight as it is.

Unpacked, each F.linear call on CPU reorders the weight into oneDNN's blocked layout before it
multiplies; packed once at load, a bench-model decode step's matrix products run 1.3-1.7x faster at
batch 1-50 (docs/BENCHMARKS.md, "Kernels"). bfloat16 results are bit-identical to F.linear's; float32's
differ in the last bits (another summation order). At batch 1-8 a product reads the whole weight for a few
rows: oneDNN's reads it at about half the rate two AVX2 cores stream memory, and the native kernel
(kernels/cpu/linear.cpp) at the full rate, 1.5x faster at batch 1 on the AVX2 EPYC (docs/BENCHMARKS.md, "On
the AVX2 EPYC"). It needs the weight in its own row-major layout, so a layer holds both copies where memory
allows (the model runner decides) and the LM head always (its dense weight is kept for a tied embedding). A packed
product of more than 256 rows runs on a row-count bucket, zero-padded (`padded_rows`), so that oneDNN builds a
primitive per bucket and not per step size. The kernel backend chooses the packer (kernels/backend.py); the
parallel layers only hold what it returns.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import switched_on

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Rows of activations up to which the native small-batch product beats oneDNN's packed one on float32 weights
# (the two cross between 8 and 16 rows: docs/BENCHMARKS.md, "On the AVX2 EPYC")
SMALL_BATCH_MAX_ROWS = 8
# Row counts up to which oneDNN's packed product runs on the rows as they are (see padded_rows)
EXACT_ROWS_MAX = 256
# SHARDSERVE_LINEAR_ROW_BUCKETS=0: every product on its rows as they are (to measure what the buckets do)
ROW_BUCKETS = switched_on("SHARDSERVE_LINEAR_ROW_BUCKETS")


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


class PackedLinearWeight:
    """A [out, in] CPU weight in oneDNN's blocked layout; with `small_batch` (the native kernel) also kept as it
    is, for products of at most SMALL_BATCH_MAX_ROWS float32 rows."""

    def __init__(self, weight: torch.Tensor, small_batch: Callable | None = None):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        use_small = small_batch is not None and weight.dtype == torch.float32
        self.small_batch = small_batch if use_small else None
        self.dense = weight.detach() if use_small else None  # keeps the weight's storage when the layer drops it

    @property
    def nbytes(self) -> int:
        """The packed copy's bytes: what stands in for the weight (parallel.layers.weight_bytes)."""
        return self.packed.numel() * self.packed.element_size()

    @property
    def dense_copy_bytes(self) -> int:
        """The bytes of the dense copy held beside the packed one for the small-batch kernel (0: none)."""
        return self.dense.numel() * self.dense.element_size() if self.dense is not None else 0

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [n, in] -> [n, out]
        if self.small_batch is not None and x.shape[0] <= SMALL_BATCH_MAX_ROWS and x.dtype == torch.float32:
            return self.small_batch(x, self.dense, bias)
        rows = x.shape[0]
        padded = padded_rows(rows)
        if padded == rows:
            return onednn_linear(x, self.packed, bias)
        padded_x = x.new_empty((padded, x.shape[1]))
        padded_x[:rows].copy_(x)
        padded_x[rows:].zero_()
        return onednn_linear(padded_x, self.packed, bias)[:rows]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedLinearWeight | None) -> torch.Tensor:
    """x W^T (+ bias) with the packed copy where there is one."""
    if packed is not None:
        return packed.matmul(x, bias)
    return F.linear(x, weight, bias)


def no_packing(weight: torch.Tensor, keep_dense: bool = False) -> None:
    """The torch and Triton backends multiply the weight as it is."""
    return None


def onednn_packer(small_batch: Callable | None = None) -> Callable[..., PackedLinearWeight | None]:
    """The native CPU backend's packer; `small_batch`: the native small-batch kernel, for the weights the caller
    lets it keep dense (`keep_dense`)."""

    def pack(weight: torch.Tensor, keep_dense: bool = False) -> PackedLinearWeight | None:
        """A CPU float32 or bfloat16 weight, packed; anything else as it is, and so is a bfloat16 weight on a CPU
        whose oneDNN cannot pack one (it needs AVX-512 or AVX-NE-CONVERT; on AVX2 alone its reorder raises, and
        F.linear still multiplies bfloat16)."""
        if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES:
            return None
        try:
            return PackedLinearWeight(weight, small_batch if keep_dense else None)
        except RuntimeError:
            if weight.dtype != torch.bfloat16:
                raise
            return None

    return pack


pack_for_onednn = onednn_packer()  # oneDNN's layout alone
