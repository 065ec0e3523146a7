"""Writing new K/V into the paged cache, in Triton. Same contract as `write_kv_cache_torch`
(kernels/cache.py): cache layout [2, num_kv_heads, num_blocks, block_size, head_dim]; a slot is
block_id * block_size + offset_in_block; slot -1 marks a padding token, whose K/V are dropped."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_kv_heads, num_blocks, block_size, head_dim]
    value_cache_ptr,  # [num_kv_heads, num_blocks, block_size, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_head,
    stride_cache_block,
    stride_cache_token,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    keep = (h[:, None] * 0 + slot) >= 0  # [BLOCK_H, 1]: padding tokens (slot -1) write nothing
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & keep
    key = tl.load(key_ptr + token * stride_key_token + h[:, None] * stride_key_head + d[None, :], mask=mask)
    value = tl.load(
        value_ptr + token * stride_value_token + h[:, None] * stride_value_head + d[None, :], mask=mask
    )
    block = slot // BLOCK_SIZE
    cache = h[:, None] * stride_cache_head + block * stride_cache_block
    cache += (slot % BLOCK_SIZE) * stride_cache_token + d[None, :]  # [BLOCK_H, BLOCK_D]
    tl.store(key_cache_ptr + cache, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_kv_heads, num_blocks, block_size, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Scatter each token's K/V into its slot (in place)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    assert kv_cache.stride(-1) == 1, "the KV cache's head_dim must be contiguous"
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[3],
    )
