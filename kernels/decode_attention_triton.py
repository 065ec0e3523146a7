"""Paged decode attention in Triton: one query token per sequence, online softmax, optional split-K.

Same contract as `paged_decode_attention_torch` (kernels/attention.py): KV cache layout
[2, num_kv_heads, num_blocks, block_size, head_dim]; block_tables entries past a sequence's context are
never read, so their value does not matter (0 or -1 both work).

One program handles one (sequence, KV head) pair and all the query heads that share that KV head
(grouped-query attention): each K/V byte is read once per sequence. When there are too few
(sequence, KV head) pairs to fill the GPU and the contexts are long, the context is split into
partitions handled by separate programs (split-K); a second kernel merges their partial softmaxes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_launch import dot_precision, is_interpreter, multiprocessor_count

LOG2E = 1.4426950408889634
PARTITION_SIZE = 512  # split-K's context tokens per program, before rounding to BLOCK_N


@triton.jit
def _decode_partition_kernel(
    out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32 (split) or [num_seqs, num_heads, head_dim]
    max_ptr,  # [num_seqs, num_heads, num_splits] float32 running max (split only)
    sum_ptr,  # [num_seqs, num_heads, num_splits] float32 softmax denominator (split only)
    query_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,  # [num_kv_heads, num_blocks, block_size, head_dim]
    value_cache_ptr,  # [num_kv_heads, num_blocks, block_size, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    context_lens_ptr,  # [num_seqs] int32
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    partition_size,  # tokens per split (a multiple of BLOCK_N)
    stride_q_seq,
    stride_q_head,
    stride_cache_head,
    stride_cache_block,
    stride_cache_token,
    stride_table_seq,
    stride_out_seq,
    stride_out_head,
    stride_out_split,
    stride_stat_seq,
    stride_stat_head,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to a tl.dot-friendly power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # the cache's tokens per block
    BLOCK_N: tl.constexpr,  # tokens per loop iteration
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,  # do the dots in float32 (the interpreter's bf16 arithmetic is wrong)
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    if SPLIT:
        start = split * partition_size
        end = tl.minimum(context_len, start + partition_size)
    else:
        start = 0
        end = context_len

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + g  # [BLOCK_G]
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        query_ptr + seq * stride_q_seq + head[:, None] * stride_q_head + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq * stride_table_seq
    k_base = key_cache_ptr + kv_head.to(tl.int64) * stride_cache_head
    v_base = value_cache_ptr + kv_head.to(tl.int64) * stride_cache_head
    for tile_start in range(start, end, BLOCK_N):
        t = tile_start + tl.arange(0, BLOCK_N)  # token positions [BLOCK_N]
        t_mask = t < end
        block = tl.load(table_row + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        slot = block * stride_cache_block + (t % BLOCK_SIZE) * stride_cache_token  # [BLOCK_N]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_base + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # Unnormalised partial result; an empty partition leaves (acc=0, max=-inf, sum=0).
        out = out_ptr + seq * stride_out_seq + head[:, None] * stride_out_head + split * stride_out_split
        tl.store(out + d[None, :], acc, mask=out_mask)
        stat = seq * stride_stat_seq + head * stride_stat_head + split
        tl.store(max_ptr + stat, m_i, mask=g_mask)
        tl.store(sum_ptr + stat, l_i, mask=g_mask)
    else:
        out = out_ptr + seq * stride_out_seq + head[:, None] * stride_out_head + d[None, :]
        tl.store(out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_partitions_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    partial_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32
    max_ptr,  # [num_seqs, num_heads, num_splits] float32
    sum_ptr,  # [num_seqs, num_heads, num_splits] float32
    num_splits,
    stride_out_seq,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # num_splits padded to a power of two
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    row = (seq * num_heads + head) * num_splits
    m = tl.load(max_ptr + row + s, mask=s_mask, other=float("-inf"))  # [BLOCK_S]
    l_part = tl.load(sum_ptr + row + s, mask=s_mask, other=0.0)
    m_all = tl.max(m, axis=0)
    weight = tl.where(s_mask, tl.exp2(m - m_all), 0.0)  # empty partitions: exp2(-inf) = 0
    partial = tl.load(
        partial_ptr + (row + s[:, None]) * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    total = tl.sum(weight * l_part, axis=0)
    out = tl.sum(partial * weight[:, None], axis=0) / total
    tl.store(
        out_ptr + seq * stride_out_seq + head * stride_out_head + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context_len: int, partition_size: int, device
) -> int:
    """Split-K only pays when (sequence, KV head) pairs are too few to fill the GPU and contexts are long."""
    programs = num_seqs * num_kv_heads
    target = 2 * multiprocessor_count(device)
    if programs >= target or max_context_len <= partition_size:
        return 1
    return max(1, min(triton.cdiv(max_context_len, partition_size), triton.cdiv(target, programs)))


def tokens_per_iteration(device) -> int:
    """BLOCK_N: cached tokens each program reads per loop iteration (smaller under the interpreter)."""
    return 32 if is_interpreter(device) else 64


def context_partitions(
    num_seqs: int, num_kv_heads: int, max_context_len: int, device, num_splits: int | None = None
) -> tuple[int, int]:
    """(num_splits, partition_size) of a decode launch: host integers only, so the launch needs no sync."""
    block_n = tokens_per_iteration(device)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context_len, PARTITION_SIZE, device)
    partition_size = triton.cdiv(triton.cdiv(max_context_len, num_splits), block_n) * block_n
    return triton.cdiv(max_context_len, partition_size), partition_size


def paged_decode_attention_triton(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    max_context_len: int | None = None,  # an upper bound; default: the block table's width (no host sync)
    num_splits: int | None = None,  # force the number of context partitions (tests); default: heuristic
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence against all of its cached tokens."""
    num_seqs, num_heads, head_dim = query.shape
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    assert kv_cache.stride(-1) == 1, "the KV cache's head_dim must be contiguous"
    interpreter = is_interpreter(query.device)
    block_n = tokens_per_iteration(query.device)
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    num_splits, partition_size = context_partitions(
        num_seqs, num_kv_heads, max_context_len, query.device, num_splits
    )
    split = num_splits > 1

    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if split:
        partial = torch.empty(
            num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device
        )
        part_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
        target, stride_split = partial, partial.stride(2)
    else:
        partial = part_max = part_sum = out  # unused by the kernel when SPLIT is off
        target, stride_split = out, 0
    block_d = triton.next_power_of_2(head_dim)
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_splits)](
        target,
        part_max,
        part_sum,
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        scale * LOG2E,
        partition_size,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        target.stride(0),
        target.stride(1),
        stride_split,
        part_max.stride(0) if split else 0,
        part_max.stride(1) if split else 0,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SPLIT=split,
        UPCAST=interpreter,
        PRECISION=dot_precision(query.dtype),
        num_warps=4,
        num_stages=2,
    )
    if split:
        _merge_partitions_kernel[(num_seqs, num_heads)](
            out,
            partial,
            part_max,
            part_sum,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(num_splits),
        )
    return out
