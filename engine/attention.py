"""The attention layer the models use, and the per-step metadata passed down to it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.backend import KernelBackend


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged cache. Built once per step by the model runner.

    The batch is ordered decodes first (one token each), then prefill chunks.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each token's K/V, -1 = padding
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32, including the new token
    num_prefill_tokens: int
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32
    prefill_context_lens: torch.Tensor  # [num_prefills] int32, cached + this chunk
    prefill_max_query_len: int = 0  # the longest chunk, known on the host (no device sync to find it)


class Attention(nn.Module):
    """Writes this layer's new K/V into its paged cache, then attends over the cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: KernelBackend):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_kv_heads, num_blocks, block_size, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        self.backend.write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        num_decode = meta.num_decode_tokens
        parts = []
        if num_decode:
            parts.append(
                self.backend.paged_decode_attention(
                    query[:num_decode], kv_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale
                )
            )
        if meta.num_prefill_tokens:
            parts.append(
                self.backend.paged_prefill_attention(
                    query[num_decode:],
                    kv_cache,
                    meta.prefill_block_tables,
                    meta.prefill_query_start_loc,
                    meta.prefill_context_lens,
                    self.scale,
                    max_query_len=meta.prefill_max_query_len,
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
