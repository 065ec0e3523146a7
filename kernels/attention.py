"""Attention over the paged KV cache: decode (one query per sequence) and prefill (chunks).

KV cache layout: see kernels/cache.py — [2, num_kv_heads, num_blocks, block_size, head_dim].
block_tables: [num_seqs, max_blocks_per_seq] int32; entries past a sequence's last block are
padding (any valid block id, e.g. 0) and are masked by context_lens.
context_lens: [num_seqs] int32, the number of tokens in the cache for each sequence *including*
the tokens of this step (their K/V are written before attention runs).
Grouped-query attention: query head h reads KV head h // (num_heads // num_kv_heads).
"""

import torch
import torch.nn.functional as F


def _gather_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather every sequence's blocks once: K and V as [num_kv_heads, num_seqs, max_context, head_dim]."""
    _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
    num_seqs, max_blocks = block_tables.shape
    flat_ids = block_tables.reshape(-1).long()
    shape = (num_kv_heads, num_seqs, max_blocks * block_size, head_dim)
    key = kv_cache[0].index_select(1, flat_ids).view(shape)
    value = kv_cache[1].index_select(1, flat_ids).view(shape)
    return key, value


def paged_decode_attention_torch(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence against all of its cached tokens, batched over sequences.

    On CPU the gathers, not the matmuls, dominate (docs/BENCHMARKS.md, "Kernels"): keys are gathered
    once, values never are: embedding_bag sums the probability-weighted value rows straight out of the
    cache, about a fifth less CPU time than gathering them and multiplying.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, num_kv_heads, num_blocks, block_size, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    device = query.device
    key = kv_cache[0].index_select(1, block_tables.reshape(-1).long())
    key = key.view(num_kv_heads, num_seqs, max_context, head_dim)
    q = query.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1)  # [kv_heads, seqs, group, dim]
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale  # [kv_heads, seqs, group, ctx]
    pad = torch.arange(max_context, device=device)[None, :] >= context_lens[:, None]  # [seqs, ctx]
    scores.masked_fill_(pad[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(kv_cache.dtype)

    # The row of each (kv head, sequence, position) in the values seen as [kv_heads * slots, head_dim];
    # int32 where it fits, which embedding_bag reads faster.
    index_dtype = torch.int32 if num_kv_heads * num_blocks * block_size < 2**31 else torch.int64
    slots = block_tables.to(index_dtype)[:, :, None] * block_size
    slots = slots + torch.arange(block_size, device=device, dtype=index_dtype)  # [seqs, max_blocks, block]
    head_offset = torch.arange(num_kv_heads, device=device, dtype=index_dtype) * (num_blocks * block_size)
    rows = slots.view(1, num_seqs, 1, max_context) + head_offset.view(num_kv_heads, 1, 1, 1)
    rows = rows.expand(num_kv_heads, num_seqs, group, max_context).reshape(-1, max_context)  # a bag per head
    values = kv_cache[1].reshape(num_kv_heads * num_blocks * block_size, head_dim)
    out = F.embedding_bag(rows, values, mode="sum", per_sample_weights=probs.reshape(-1, max_context))
    out = out.view(num_kv_heads, num_seqs, group, head_dim).transpose(0, 1)
    return out.reshape(num_seqs, num_heads, head_dim)


def paged_prefill_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_kv_heads, num_blocks, block_size, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    context_lens: torch.Tensor,  # [num_seqs] int32, cached tokens including this chunk
    scale: float,
    *,
    max_query_len: int | None = None,  # the longest chunk; default: computed from query_start_loc
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Each sequence's chunk of queries attends to its cached prefix and causally within the chunk.

    The chunk occupies the last `query_len` positions of the sequence's context, so query i
    (0-based in the chunk) sits at position context_len - query_len + i. Batched over sequences
    by padding every chunk to the longest one.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = block_tables.shape[0]
    num_kv_heads = kv_cache.shape[1]
    group = num_heads // num_kv_heads
    device = query.device
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()  # [seqs]
    if not max_query_len:
        max_query_len = int(query_lens.max())
    key, value = _gather_kv(kv_cache, block_tables)  # [kv_heads, seqs, ctx, head_dim]
    max_context = key.shape[2]

    # Scatter the flat queries into a padded [seqs, max_query_len] grid.
    offsets = torch.arange(max_query_len, device=device)  # [max_q]
    valid_q = offsets[None, :] < query_lens[:, None]  # [seqs, max_q]
    token_index = (query_start_loc[:-1, None].long() + offsets[None, :]).masked_fill(~valid_q, 0)

    if bool((context_lens.long() == query_lens).all()):
        # Fresh prompts (nothing cached before the chunk): plain causal attention, which SDPA runs
        # without a mask and skips the masked half. Query i sees keys 0..i of its own sequence,
        # all valid even in a padded row; padded queries are dropped below.
        q = query[token_index.reshape(-1)].view(num_seqs, max_query_len, num_heads, head_dim).transpose(1, 2)
        k = key[:, :, :max_query_len].repeat_interleave(group, dim=0).transpose(0, 1)  # [seqs, heads, max_q, d]
        v = value[:, :, :max_query_len].repeat_interleave(group, dim=0).transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)  # [seqs, heads, max_q, d]
        out = out.transpose(1, 2).reshape(num_seqs * max_query_len, num_heads, head_dim)
        return out[valid_q.reshape(-1)]

    q = query[token_index.reshape(-1)].view(num_seqs, max_query_len, num_kv_heads, group, head_dim)
    q = q.permute(2, 0, 3, 1, 4).reshape(num_kv_heads, num_seqs, group * max_query_len, head_dim)

    # Causal mask over absolute positions: key j is visible to query i if j <= position(i).
    q_pos = (context_lens[:, None].long() - query_lens[:, None]) + offsets[None, :]  # [seqs, max_q]
    k_pos = torch.arange(max_context, device=device)
    visible = k_pos[None, None, :] <= q_pos[:, :, None]  # [seqs, max_q, ctx]
    visible = visible | ~valid_q[:, :, None]  # padded queries see everything (discarded later)
    mask = visible[:, None].expand(num_seqs, group, max_query_len, max_context)
    mask = mask.reshape(1, num_seqs, group * max_query_len, max_context)

    # SDPA's fused CPU kernel never materialises the scores: ~3x less CPU time than matmul + softmax.
    out = F.scaled_dot_product_attention(
        q, key, value, attn_mask=mask, scale=scale
    )  # [kv_heads, seqs, g*q, d]
    out = out.view(num_kv_heads, num_seqs, group, max_query_len, head_dim).permute(1, 3, 0, 2, 4)
    out = out.reshape(num_seqs * max_query_len, num_heads, head_dim)
    return out[valid_q.reshape(-1)]
