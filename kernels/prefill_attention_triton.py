"""Paged prefill attention in Triton: variable-length query chunks over the paged KV cache.

Same contract as `paged_prefill_attention_torch` (kernels/attention.py). A sequence's chunk holds its
last `query_len` context positions (its K/V are already in the cache), so query i of the chunk sits at
position context_len - query_len + i and sees keys 0..that position: the cached prefix (earlier chunks
or a prefix-cache hit) plus the chunk itself, causally. Chunks may start anywhere inside a block.

Flash-attention style: one program per (tile of BLOCK_M queries, query head, sequence) walks the
sequence's keys in tiles of BLOCK_N through the block table with an online softmax, and stops at the
tile's last visible key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_launch import dot_precision, is_interpreter

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_kv_heads, num_blocks, block_size, head_dim]
    value_cache_ptr,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    context_lens_ptr,  # [num_seqs] int32
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_head,
    stride_cache_block,
    stride_cache_token,
    stride_table_seq,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # the cache's tokens per block
    BLOCK_M: tl.constexpr,  # queries per program
    BLOCK_N: tl.constexpr,  # keys per loop iteration
    UPCAST: tl.constexpr,  # do the dots in float32 (the interpreter's bf16 arithmetic is wrong)
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    context_len = tl.load(context_lens_ptr + seq)
    first_position = context_len - query_len  # position of the chunk's first query

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index inside the chunk [BLOCK_M]
    d = tl.arange(0, BLOCK_D)
    m_mask = m < query_len
    d_mask = d < HEAD_DIM
    q_position = first_position + m  # [BLOCK_M]
    token = (q_start + m).to(tl.int64)
    q = tl.load(
        query_ptr + token[:, None] * stride_q_token + head * stride_q_head + d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    # Keys past the tile's last query are invisible to all of it; a tile past the chunk does nothing.
    kv_end = tl.minimum(context_len, first_position + (tile + 1) * BLOCK_M)
    kv_end = tl.where(tile * BLOCK_M < query_len, kv_end, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq * stride_table_seq
    k_base = key_cache_ptr + kv_head.to(tl.int64) * stride_cache_head
    v_base = value_cache_ptr + kv_head.to(tl.int64) * stride_cache_head
    for tile_start in range(0, kv_end, BLOCK_N):
        t = tile_start + tl.arange(0, BLOCK_N)  # key positions [BLOCK_N]
        t_mask = t < kv_end
        block = tl.load(table_row + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        slot = block * stride_cache_block + (t % BLOCK_SIZE) * stride_cache_token  # [BLOCK_N]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_base + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        # Key 0 is visible to every row, so the first tile gives each row a finite max.
        visible = (t[None, :] <= q_position[:, None]) & t_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows past the chunk: stored nowhere, kept finite
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_out_token + head * stride_out_head + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    context_lens: torch.Tensor,  # [num_seqs] int32, cached tokens including this chunk
    scale: float,
    *,
    max_query_len: int | None = None,  # the longest chunk (the host knows it); default: num_tokens, a bound
    config: tuple[int, int, int, int] | None = None,  # (BLOCK_M, BLOCK_N, num_warps, num_stages); a sweep's
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Each sequence's chunk of queries attends to its cached prefix and causally within the chunk."""
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    num_seqs = block_tables.shape[0]
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    assert kv_cache.stride(-1) == 1, "the KV cache's head_dim must be contiguous"
    if max_query_len is None:  # reading it from query_start_loc would wait for the device; tiles past a chunk stop at once
        max_query_len = num_tokens
    interpreter = is_interpreter(query.device)
    if config is None:
        config = (16, 32, 4, 2) if interpreter else (64, 64, 4 if head_dim <= 64 else 8, 2)
    block_m, block_n, num_warps, num_stages = config
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    grid = (triton.cdiv(max_query_len, block_m), num_heads, num_seqs)
    _prefill_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        UPCAST=interpreter,
        PRECISION=dot_precision(query.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
