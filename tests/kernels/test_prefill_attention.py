"""Paged prefill attention: chunks of queries over their cached prefix plus causally within the chunk."""

import pytest
import torch
from kernel_float64_spec import assert_close_to_spec, prefill_attention
from native_builds import amx_tiles_expected
from paged_inputs import random_kv_cache, scattered_block_tables

pytestmark = pytest.mark.usefixtures("poisoned_allocations")

NUM_KV_HEADS = 2

# (block_size, head_dim, query heads per KV head, dtype)
CASES = [
    (16, 64, 1, torch.float32),
    (32, 128, 2, torch.float32),
    (16, 128, 4, torch.bfloat16),
    (32, 64, 4, torch.float32),
    (16, 64, 2, torch.bfloat16),
]


def chunks_for(block_size: int) -> list[tuple[int, int]]:
    """(tokens already cached, tokens in this chunk) per sequence."""
    return [
        (0, block_size + 7),  # a whole prompt in one chunk, ending mid-block
        (block_size + 3, 9),  # a later chunk starting mid-block (chunked prefill)
        (2 * block_size, 1),  # a one-token chunk right after a prefix-cache hit of whole blocks
        (5, 2 * block_size - 2),  # a chunk spanning several blocks from mid-block
    ]


@pytest.mark.parametrize("block_size, head_dim, group, dtype", CASES)
def test_prefill_attention_matches_float64_spec(backend, block_size, head_dim, group, dtype):
    generator = torch.Generator().manual_seed(block_size * 1000 + head_dim + group)
    chunks = chunks_for(block_size)
    context_lens = [cached + new for cached, new in chunks]
    query_lens = [new for _, new in chunks]
    kv_cache = random_kv_cache(NUM_KV_HEADS, 16, block_size, head_dim, dtype, generator)
    block_tables = scattered_block_tables(context_lens, block_size, 16, generator)
    query = torch.randn(sum(query_lens), NUM_KV_HEADS * group, head_dim, generator=generator).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = head_dim**-0.5

    out = backend.paged_prefill_attention(query, kv_cache, block_tables, query_start_loc, lens, scale)

    assert out.dtype == dtype
    spec = prefill_attention(query, kv_cache, block_tables, query_start_loc, lens, scale)
    assert_close_to_spec(out, spec, dtype)


def test_prefill_of_a_one_token_chunk_equals_decode(backend):
    """A chunk of one token at the end of its context is exactly a decode step."""
    generator = torch.Generator().manual_seed(3)
    context_lens = [21, 40, 7]
    kv_cache = random_kv_cache(NUM_KV_HEADS, 12, 16, 64, torch.float32, generator)
    block_tables = scattered_block_tables(context_lens, 16, 12, generator)
    query = torch.randn(3, 2 * NUM_KV_HEADS, 64, generator=generator)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    query_start_loc = torch.arange(4, dtype=torch.int32)

    prefill = backend.paged_prefill_attention(query, kv_cache, block_tables, query_start_loc, lens, 0.125)
    decode = backend.paged_decode_attention(query, kv_cache, block_tables, lens, 0.125)

    torch.testing.assert_close(prefill, decode, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "head_dim, group, dtype", [(96, 3, torch.float32), (64, 7, torch.bfloat16), (256, 1, torch.float32)]
)
def test_native_cpu_prefill_over_many_query_tiles_and_blocks(native_target, native, head_dim, group, dtype):
    """The C++ kernel tiles 64 chunk positions at a time and packs a tile's (head, position) rows densely:
    chunks longer than a tile, starting mid-block after a cached prefix, one-token chunks, speculative
    verifications (a few positions at the end of a long context), odd group sizes, head_dim up to 256."""
    from kernels import cpu_native

    # the native kernel, not the reference, runs wherever it was built with vector code (AVX-512 or AVX2)
    has_vector_code = cpu_native.load(native_target).vector_isa() != "scalar"
    assert cpu_native.prefill_supported(head_dim, 16, native_target) == has_vector_code
    generator = torch.Generator().manual_seed(head_dim + group)
    chunks = [(0, 200), (130, 75), (64, 64), (3, 1), (0, 65), (300, 5), (41, 3), (16, 2)]
    context_lens = [cached + new for cached, new in chunks]
    query_lens = [new for _, new in chunks]
    kv_cache = random_kv_cache(NUM_KV_HEADS, 80, 16, head_dim, dtype, generator)
    block_tables = scattered_block_tables(context_lens, 16, 80, generator)
    query = torch.randn(sum(query_lens), NUM_KV_HEADS * group, head_dim, generator=generator).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)

    out = native.paged_prefill_attention(query, kv_cache, block_tables, query_start_loc, lens, 0.1)

    assert out.dtype == dtype and out.shape == query.shape
    assert_close_to_spec(out, prefill_attention(query, kv_cache, block_tables, query_start_loc, lens, 0.1), dtype)


def test_native_cpu_prefill_leaves_what_it_cannot_take_to_the_reference(native_target):
    from kernels import cpu_native

    assert not cpu_native.prefill_supported(72, 16, native_target)  # head_dim not a multiple of 16
    assert not cpu_native.prefill_supported(64, 32, native_target)  # blocks of 32 tokens
    assert not cpu_native.prefill_supported(272, 16, native_target)  # head_dim over 256


@pytest.mark.parametrize("head_dim, group", [(64, 1), (64, 4), (128, 2), (64, 3), (128, 7)])
def test_amx_prefill_of_bfloat16_chunks_matches_the_spec(native_target, native, head_dim, group):
    """On a CPU with AMX the native build runs every bfloat16 chunk on AMX tiles (the weights rounded to bfloat16
    for P V, as torch's bfloat16 attention rounds them), in tiles of 16 rows taken head by head: a long chunk's
    tile is 16 positions of one head (with a short last one), a short chunk's packs the group's heads together
    (a speculative verification of 5 positions: 15 rows with 3 heads a KV head, 35 over three tiles with 7), and a
    tile may hold the end of one head and the start of the next. Chunks start mid-block after a cached prefix, are
    exactly one and two tiles, one token, and end past 32 keys' padding."""
    from kernels import cpu_native

    assert cpu_native.load(native_target).prefill_amx_available() == amx_tiles_expected(native_target)
    generator = torch.Generator().manual_seed(head_dim * 7 + group)
    chunks = [(0, 17), (0, 16), (5, 32), (130, 75), (300, 5), (0, 143), (47, 18), (16, 2), (40, 1), (601, 5),
              (33, 4)]
    context_lens = [cached + new for cached, new in chunks]
    query_lens = [new for _, new in chunks]
    kv_cache = random_kv_cache(NUM_KV_HEADS, 120, 16, head_dim, torch.bfloat16, generator)
    block_tables = scattered_block_tables(context_lens, 16, 120, generator)
    query = torch.randn(sum(query_lens), NUM_KV_HEADS * group, head_dim, generator=generator).to(torch.bfloat16)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = head_dim**-0.5

    out = native.paged_prefill_attention(query, kv_cache, block_tables, query_start_loc, lens, scale)

    spec = prefill_attention(query, kv_cache, block_tables, query_start_loc, lens, scale)
    assert_close_to_spec(out, spec, torch.bfloat16)
