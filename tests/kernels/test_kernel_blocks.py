"""KV-cache blocks of 32-256 tokens on the native CPU attention kernels: read as runs of 16-token blocks."""

import pytest
import torch
from paged_inputs import random_kv_cache, scattered_block_tables

from kernels.backend import CPU_KERNEL_BLOCK, KernelBlockTables, as_kernel_blocks

pytestmark = pytest.mark.usefixtures("poisoned_allocations")


def sixteen_token_view(kv_cache, block_tables):
    """The same cache and tables in blocks of 16, written out by hand."""
    runs = kv_cache.shape[3] // 16
    two, kv_heads, blocks, _, head_dim = kv_cache.shape
    tables = (block_tables[:, :, None] * runs + torch.arange(runs, dtype=torch.int32)).reshape(len(block_tables), -1)
    return kv_cache.reshape(two, kv_heads, blocks * runs, 16, head_dim), tables


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [32, 64, 128])
def test_native_attention_on_big_blocks_equals_it_on_the_same_cache_in_blocks_of_16(native, block_size, dtype):
    """Decode and prefill (chunks ending mid-block, a chunk after a cached prefix) over scattered blocks of
    `block_size` give bit for bit what each native build gives on the 16-token view of the same cache."""
    backend = native
    generator = torch.Generator().manual_seed(block_size)
    kv_heads, group, head_dim, num_blocks = 2, 3, 64, 9
    kv_cache = random_kv_cache(kv_heads, num_blocks, block_size, head_dim, dtype, generator)
    lens = [1, block_size + 5, 3 * block_size - 1, 2 * block_size]
    tables = scattered_block_tables(lens, block_size, num_blocks, generator)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    view_cache, view_tables = sixteen_token_view(kv_cache, tables)

    query = torch.randn(len(lens), kv_heads * group, head_dim, generator=generator).to(dtype)
    out = backend.paged_decode_attention(query, kv_cache, tables, context_lens, 0.125)
    assert torch.equal(out, backend.paged_decode_attention(query, view_cache, view_tables, context_lens, 0.125))

    query_lens = [1, 7, block_size, 2 * block_size]  # each chunk ends its sequence's context
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    queries = torch.randn(sum(query_lens), kv_heads * group, head_dim, generator=generator).to(dtype)
    got = backend.paged_prefill_attention(queries, kv_cache, tables, starts, context_lens, 0.125,
                                          max_query_len=max(query_lens))
    want = backend.paged_prefill_attention(queries, view_cache, view_tables, starts, context_lens, 0.125,
                                           max_query_len=max(query_lens))
    assert torch.equal(got, want)


def test_blocks_of_16_or_off_the_16_grid_pass_through_unchanged():
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    for block_size in (8, 16, 24):
        cache = torch.zeros(2, 1, 4, block_size, 8)
        assert as_kernel_blocks(cache, tables, KernelBlockTables()) == (cache, tables)
    strided = torch.zeros(2, 1, 4, 64, 16)[..., :8]  # not contiguous: no view of it in blocks of 16
    assert as_kernel_blocks(strided, tables, KernelBlockTables())[0] is strided


def test_a_steps_table_is_made_once_and_again_after_it_is_written_in_place():
    """Every layer of a step passes the same table: the 16-token table is made for the first and reused; a table
    written in place (a buffer reused from step to step) is made again."""
    made = KernelBlockTables()
    tables = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    first = made(tables, 4)
    assert first.tolist() == [[8, 9, 10, 11, 0, 1, 2, 3], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert made(tables, 4) is first
    assert made(tables.clone(), 4) is not first  # another step's table
    tables[0, 0] = 3
    assert made(tables, 4)[0, :4].tolist() == [12, 13, 14, 15]
    assert made(tables, 2).shape == (2, 4)
    assert CPU_KERNEL_BLOCK == 16
