"""Rotary position embedding in Triton (Llama / GPT-NeoX halves). Same contract as
`rotary_embedding_torch` (kernels/rotary.py); scaling (linear, llama3) lives in the cos/sin cache
that `rope_cos_sin_cache` builds, so the kernel only looks positions up in it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    out_ptr,
    x_ptr,
    token,
    cos,  # [1, BLOCK_HALF] float32
    sin,  # [1, BLOCK_HALF] float32
    stride_x_token,
    stride_x_head,
    stride_out_token,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[:, None]
    c = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NUM_HEADS) & (c < HALF)
    x = x_ptr + token * stride_x_token + h * stride_x_head + c
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_HALF]
    x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + token * stride_out_token + h * stride_out_head + c
    tl.store(out, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    query_out_ptr,  # [num_tokens, num_heads, head_dim]
    key_out_ptr,  # [num_tokens, num_kv_heads, head_dim]
    query_ptr,
    key_ptr,
    positions_ptr,  # [num_tokens] int64
    cos_sin_ptr,  # [max_position, head_dim] float32 (cos || sin)
    num_positions,  # max_position: the table's rows
    stride_cos_sin,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_qo_token,
    stride_qo_head,
    stride_ko_token,
    stride_ko_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    # a position past the table reads no memory beyond it (its q and k come out zero): the model's table
    # covers max_model_len (CausalLM.cover_positions), and the torch reference raises on such a position
    c = tl.arange(0, BLOCK_HALF)[None, :]
    at = c * 0 + position  # [1, BLOCK_HALF]: the position broadcast, so the mask is a tensor like the load's
    mask = (c < HALF) & (at >= 0) & (at < num_positions)
    row = cos_sin_ptr + position * stride_cos_sin
    cos = tl.load(row + c, mask=mask, other=0.0)  # [1, BLOCK_HALF]
    sin = tl.load(row + HALF + c, mask=mask, other=0.0)
    _rotate_heads(
        query_out_ptr, query_ptr, token, cos, sin,
        stride_q_token, stride_q_head, stride_qo_token, stride_qo_head,
        NUM_HEADS, BLOCK_H, HALF, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        key_out_ptr, key_ptr, token, cos, sin,
        stride_k_token, stride_k_head, stride_ko_token, stride_ko_head,
        NUM_KV_HEADS, BLOCK_KV_H, HALF, BLOCK_HALF,
    )  # fmt: skip


def rotary_embedding_triton(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32 (cos || sin)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key by their positions; returns new (query, key) in their input dtype."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    half = cos_sin_cache.shape[-1] // 2
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1:
        key = key.contiguous()
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            query_out,
            key_out,
            query,
            key,
            positions,
            cos_sin_cache,
            cos_sin_cache.shape[0],
            cos_sin_cache.stride(0),
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(1),
            query_out.stride(0),
            query_out.stride(1),
            key_out.stride(0),
            key_out.stride(1),
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_KV_H=triton.next_power_of_2(num_kv_heads),
            HALF=half,
            BLOCK_HALF=triton.next_power_of_2(half),
        )
    return query_out, key_out
