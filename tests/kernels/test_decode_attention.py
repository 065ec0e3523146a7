"""Paged decode attention: one new query per sequence against its whole cached context."""

import pytest
import torch
from kernel_float64_spec import assert_close_to_spec, decode_attention
from paged_inputs import random_kv_cache, scattered_block_tables

from kernels.decode_attention_triton import choose_num_splits, paged_decode_attention_triton

pytestmark = pytest.mark.usefixtures("poisoned_allocations")

NUM_KV_HEADS = 2

# (block_size, head_dim, query heads per KV head, dtype, forced context partitions for Triton's split-K)
CASES = [
    (16, 64, 1, torch.float32, None),
    (32, 128, 2, torch.float32, None),
    (16, 128, 4, torch.bfloat16, None),
    (32, 64, 1, torch.bfloat16, None),
    (16, 64, 2, torch.float32, 3),
    (32, 128, 4, torch.bfloat16, 2),
]


@pytest.mark.parametrize("block_size, head_dim, group, dtype, num_splits", CASES)
def test_decode_attention_matches_float64_spec(backend, block_size, head_dim, group, dtype, num_splits):
    generator = torch.Generator().manual_seed(block_size * 1000 + head_dim + group)
    # Lengths off the block grid: one token, a block and a bit, several blocks minus one.
    context_lens = [1, block_size + 5, 3 * block_size - 1, 2 * block_size + 3]
    kv_cache = random_kv_cache(NUM_KV_HEADS, 16, block_size, head_dim, dtype, generator)
    block_tables = scattered_block_tables(context_lens, block_size, 16, generator)
    query = torch.randn(len(context_lens), NUM_KV_HEADS * group, head_dim, generator=generator).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = head_dim**-0.5

    extra = {"num_splits": num_splits} if backend.name == "triton" and num_splits else {}
    out = backend.paged_decode_attention(query, kv_cache, block_tables, lens, scale, **extra)

    assert out.dtype == dtype
    assert_close_to_spec(out, decode_attention(query, kv_cache, block_tables, lens, scale), dtype)


def test_split_k_is_chosen_for_few_long_sequences_only():
    cpu = torch.device("cpu")  # stands in for a 132-multiprocessor GPU
    assert choose_num_splits(1, 8, 8192, 512, cpu) == 16
    assert choose_num_splits(4, 8, 2048, 512, cpu) == 4
    assert choose_num_splits(64, 8, 8192, 512, cpu) == 1  # 512 programs already fill the GPU
    assert choose_num_splits(1, 8, 300, 512, cpu) == 1  # one partition holds the whole context


def test_triton_decode_splits_a_long_context_by_itself():
    """A lone sequence with a long context takes the split-K path without being told to."""
    generator = torch.Generator().manual_seed(7)
    block_size, head_dim, context_len = 16, 64, 700
    num_blocks = context_len // block_size + 4
    kv_cache = random_kv_cache(1, num_blocks, block_size, head_dim, torch.float32, generator)
    block_tables = scattered_block_tables([context_len], block_size, num_blocks, generator)
    query = torch.randn(1, 2, head_dim, generator=generator)
    lens = torch.tensor([context_len], dtype=torch.int32)
    assert choose_num_splits(1, 1, block_tables.shape[1] * block_size, 512, query.device) > 1

    out = paged_decode_attention_triton(query, kv_cache, block_tables, lens, 0.125)

    assert_close_to_spec(out, decode_attention(query, kv_cache, block_tables, lens, 0.125), torch.float32)


def test_triton_decode_never_reads_the_block_table_past_a_context():
    """Entries past a sequence's last block may be anything, even -1: the kernel must not look at them."""
    generator = torch.Generator().manual_seed(11)
    context_lens = [5, 40, 17]
    kv_cache = random_kv_cache(NUM_KV_HEADS, 12, 16, 64, torch.float32, generator)
    block_tables = scattered_block_tables(context_lens, 16, 12, generator)
    query = torch.randn(3, 2 * NUM_KV_HEADS, 64, generator=generator)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    padded = block_tables.clone()
    for row, length in enumerate(context_lens):
        padded[row, -(-length // 16) :] = -1

    out = paged_decode_attention_triton(query, kv_cache, padded, lens, 0.125, num_splits=2)

    assert_close_to_spec(out, decode_attention(query, kv_cache, block_tables, lens, 0.125), torch.float32)


@pytest.mark.parametrize(
    "head_dim, group, dtype",
    [
        (80, 3, torch.float32),
        (96, 7, torch.bfloat16),
        (64, 8, torch.bfloat16),
        (128, 1, torch.float32),
        # bfloat16 head_dim 64 / 128 on AVX-512 BF16: scores on vdpbf16ps, values a few heads a pass (4 / 2) and
        # the rest one by one
        (64, 3, torch.bfloat16),
        (128, 7, torch.bfloat16),
    ],
)
def test_native_cpu_decode_handles_any_head_dim_and_group(native, head_dim, group, dtype):
    """The C++ kernel has AVX-512 and AVX2 code for head_dim 64 and 128 and plain code for the rest; groups
    of any size (Qwen2-7B shares a KV head among 7 query heads) and contexts of one to many blocks."""
    generator = torch.Generator().manual_seed(head_dim * 10 + group)
    context_lens = [1, 15, 16, 17, 250, 97]
    kv_cache = random_kv_cache(NUM_KV_HEADS, 32, 16, head_dim, dtype, generator)
    block_tables = scattered_block_tables(context_lens, 16, 32, generator)
    query = torch.randn(len(context_lens), NUM_KV_HEADS * group, head_dim, generator=generator).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)

    out = native.paged_decode_attention(query, kv_cache, block_tables, lens, 0.1)

    assert out.dtype == dtype and out.shape == query.shape
    assert_close_to_spec(out, decode_attention(query, kv_cache, block_tables, lens, 0.1), dtype)
