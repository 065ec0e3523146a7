"""Writing new K/V into the paged cache.

KV cache layout (one tensor per layer, shared by every kernel in this package):
    kv_cache: [2, num_kv_heads, num_blocks, block_size, head_dim]
    kv_cache[0] holds keys, kv_cache[1] values. Head-major: gathering the blocks of a batch
    with one index_select along dim 2 yields [num_kv_heads, num_seqs, context, head_dim]
    directly, with no further copy before the attention matmuls (the CPU path's bottleneck).
A slot is `block_id * block_size + offset_in_block`; slot -1 marks a padding token.
"""

import torch


def write_kv_cache_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_kv_heads, num_blocks, block_size, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Scatter each token's K/V into its slot (in place)."""
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    # [2, num_kv_heads, num_slots, head_dim] view of the cache
    flat = kv_cache.view(2, num_kv_heads, num_blocks * block_size, head_dim)
    flat[0].index_copy_(1, slot_mapping, key.transpose(0, 1).to(kv_cache.dtype))
    flat[1].index_copy_(1, slot_mapping, value.transpose(0, 1).to(kv_cache.dtype))
