"""Random paged-KV scenes for the attention tests: sequences scattered over shuffled cache blocks."""

from __future__ import annotations

import torch


def scattered_block_tables(
    context_lens: list[int], block_size: int, num_blocks: int, generator: torch.Generator
) -> torch.Tensor:  # [num_seqs, max_blocks] int32
    """Each sequence gets distinct blocks drawn at random (so never in order); the padding past a
    sequence's last block holds arbitrary valid block ids, as the model runner's tables may."""
    blocks_needed = [-(-length // block_size) for length in context_lens]
    max_blocks = max(blocks_needed) + 1  # at least one padding entry for every sequence
    assert sum(blocks_needed) <= num_blocks
    pool = torch.randperm(num_blocks, generator=generator)
    tables = torch.randint(0, num_blocks, (len(context_lens), max_blocks), generator=generator)
    used = 0
    for row, count in enumerate(blocks_needed):
        tables[row, :count] = pool[used : used + count]
        used += count
    return tables.to(torch.int32)


def random_kv_cache(
    num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int, dtype, generator: torch.Generator
) -> torch.Tensor:  # [2, num_kv_heads, num_blocks, block_size, head_dim]
    """Every slot random, including the ones no sequence owns: reading them changes the answer."""
    shape = (2, num_kv_heads, num_blocks, block_size, head_dim)
    return torch.randn(shape, generator=generator).to(dtype)
