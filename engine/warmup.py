"""The start-up runs on a GPU: one forward pass at the step's token budget (the profile that sizes the KV
cache, engine/gpu_memory.py), then every Triton variant the steps can need, so no request pays a compile.

A Triton kernel compiles once per variant (kernels/triton_variants.py): its constexprs and the
specialisation of its integer arguments. Most of a step's kernels see one variant per model (their
integers are the model's strides); paged attention sees more, because the block table's width
(`stride_table_seq`: 1, a multiple of 16, or neither) and decode's split-K partition count (SPLIT,
BLOCK_S and their strides) change with the batch. `decode_warmup_shapes` finds one (num_seqs, max_blocks)
per variant decode can reach under the engine's limits, from the wrapper's own host-side plan.
"""

from __future__ import annotations

import torch

from kernels.backend import KernelBackend
from kernels.triton_launch import multiprocessor_count


def _integer_class(value: int) -> str:
    """How Triton specialises an integer argument: equal to 1, divisible by 16, or neither."""
    return "1" if value == 1 else "16" if value % 16 == 0 else ""


def decode_warmup_shapes(
    num_heads: int, num_kv_heads: int, block_size: int, max_model_len: int, max_num_seqs: int, device: torch.device
) -> list[tuple[int, int]]:
    """(num_seqs, max_blocks) of one decode launch per variant the engine's steps can reach: with split-K or
    without, each BLOCK_S (the partition count's power of two) with the partition count's strides divisible
    by 16 or not, each with the block table's width equal to 1, a multiple of 16, or neither."""
    from kernels.decode_attention_triton import context_partitions

    max_blocks_limit = -(-max_model_len // block_size)
    programs_to_fill = 2 * multiprocessor_count(device)
    shapes: dict[tuple, tuple[int, int]] = {}
    caps_seen = set()
    for num_seqs in range(1, max_num_seqs + 1):
        # the partition count is capped by the programs a batch leaves to fill: batches of one cap launch alike
        cap = -(-programs_to_fill // (num_seqs * num_kv_heads))
        if cap in caps_seen:
            continue
        caps_seen.add(cap)
        for max_blocks in range(1, max_blocks_limit + 1):
            num_splits, _ = context_partitions(num_seqs, num_kv_heads, max_blocks * block_size, device)
            split = num_splits > 1
            variant = (split, 1 << (num_splits - 1).bit_length() if split else 0,
                       split and _integer_class(num_splits), split and _integer_class(num_heads * num_splits),
                       _integer_class(max_blocks))
            shapes.setdefault(variant, (num_seqs, max_blocks))
        if cap == 1:  # from here on (sequence, KV head) programs fill the GPU without splitting
            break
    return sorted(shapes.values())


def prefill_warmup_widths(block_size: int, max_model_len: int) -> list[int]:
    """Block-table widths that give prefill attention each of its variants (1, a multiple of 16, neither)."""
    limit = -(-max_model_len // block_size)
    return [width for width in (1, 2, 16) if width <= limit]


@torch.inference_mode()
def warm_up_attention(
    backend: KernelBackend,
    kv_cache: torch.Tensor,  # [2, kv_heads_per_rank, num_blocks, block_size, head_dim]: any layer's cache
    num_heads: int,
    max_model_len: int,
    max_num_seqs: int,
) -> int:
    """Launch paged attention once per variant (reading block 0 only; the cache is left as it was).
    Returns the launches made."""
    _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
    device, dtype = kv_cache.device, kv_cache.dtype
    scale = head_dim**-0.5
    launches = 0
    shapes = decode_warmup_shapes(num_heads, num_kv_heads, block_size, max_model_len, max_num_seqs, device)
    for num_seqs, max_blocks in shapes:
        query = torch.zeros(num_seqs, num_heads, head_dim, dtype=dtype, device=device)
        tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device=device)
        lens = torch.full((num_seqs,), max_blocks * block_size, dtype=torch.int32, device=device)
        backend.paged_decode_attention(query, kv_cache, tables, lens, scale)
        launches += 1
    for width in prefill_warmup_widths(block_size, max_model_len):
        query = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
        tables = torch.zeros(1, width, dtype=torch.int32, device=device)
        query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device=device)
        lens = torch.full((1,), width * block_size, dtype=torch.int32, device=device)
        backend.paged_prefill_attention(query, kv_cache, tables, query_start_loc, lens, scale, max_query_len=1)
        launches += 1
    return launches


@torch.inference_mode()
def warm_up_sampling(backend: KernelBackend, logits: torch.Tensor) -> None:
    """The fused sampler (top-k, top-p and min-p all on) and the structured-output mask over `logits`
    ([rows, vocab] float32, changed in place), as a step with every option set would run them."""
    from kernels.bitmask import bitmask_words

    rows, vocab = logits.shape
    device = logits.device
    backend.sample_tokens(
        logits,
        torch.ones(rows, device=device),
        torch.full((rows,), 50, dtype=torch.int32, device=device),
        torch.full((rows,), 0.9, device=device),
        torch.full((rows,), 0.05, device=device),
        torch.full((rows,), 0.5, dtype=torch.float64, device=device),
    )
    bitmask = torch.full((rows, bitmask_words(vocab)), -1, dtype=torch.int32, device=device)
    backend.apply_token_bitmask(logits, bitmask, torch.arange(rows, device=device))


class LinearWarmUp:
    """oneDNN's primitives for the row buckets a CPU engine's prefill steps meet, built while the engine is idle: one
    product of zeros for each (packed weight shape, row bucket above EXACT_ROWS_MAX up to `max_rows`), one product a
    `step`, largest bucket first (full steps are a loaded server's most common). oneDNN JIT-builds a primitive the
    first time it meets a row count, several times the product's own cost (kernels/linear.py padded_rows), and a
    served load's first steps meet many buckets at once: a fresh server's first wave of ten 512-token prompts reached
    its first tokens in groups at 284 / 388 / 465 ms where the steady state's groups took 150-195 ms
    (docs/BENCHMARKS.md, "Linears: oneDNN's split over two threads"). The linears' split decisions (SplitRowsChoice)
    are made here too. Every layer of a shape shares its primitives, so a shape is warmed once; the LM head
    multiplies only the sampled rows and is left out. The caller runs it on the thread that runs the steps (a
    primitive is built for the thread count it runs with). SHARDSERVE_LINEAR_WARMUP=0: nothing to do."""

    def __init__(self, model: torch.nn.Module, max_rows: int):
        from kernels import switched_on
        from kernels.linear import EXACT_ROWS_MAX, PackedLinearWeight, padded_rows
        from parallel.layers import ParallelLMHead

        self.products = 0
        self.units: list[tuple] = []  # (rows, in features, dtype, weight), the largest bucket last: `step` pops
        if not switched_on("SHARDSERVE_LINEAR_WARMUP"):
            return
        weights: dict[tuple, PackedLinearWeight] = {}
        for module in model.modules():
            packed = getattr(module, "packed_weight", None)
            if isinstance(packed, PackedLinearWeight) and not isinstance(module, ParallelLMHead):
                weights.setdefault((tuple(packed.packed.shape), packed.packed.dtype), packed)
        buckets = sorted({padded_rows(rows) for rows in range(EXACT_ROWS_MAX + 1, max_rows + 1)})
        self.units = [(rows, shape[1], dtype, packed) for rows in buckets for (shape, dtype), packed in weights.items()]

    @property
    def done(self) -> bool:
        return not self.units

    @torch.inference_mode()
    def step(self) -> bool:
        """One product; whether any are left."""
        if self.units:
            rows, features, dtype, packed = self.units.pop()
            packed.matmul(torch.zeros(rows, features, dtype=dtype), None)
            self.products += 1
        return bool(self.units)
