"""Llama-family decoder (Llama 2/3, Mistral; Qwen2 in qwen2.py is this plus QKV bias, Qwen3 in
qwen3.py this plus a per-head RMSNorm on q and k).

Built from parallel/ layers, so the same code runs at any tensor-parallel size: each rank holds
its query/KV heads and its slice of the MLP, and the row-parallel layers all-reduce. Every op
goes through the KernelBackend. Module names mirror Hugging Face's, except the fused
`qkv_proj` (q_proj, k_proj, v_proj) and `gate_up_proj` (gate_proj, up_proj): see engine/checkpoint/loader.py.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import Attention, AttentionMetadata
from engine.config import ModelConfig
from kernels.backend import KernelBackend
from kernels.rotary import rope_cos_sin_cache
from parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    replicated_weight_loader,
)
from parallel.state import ParallelContext


class RMSNorm(nn.Module):
    """RMSNorm; with `residual`, fused with the residual add before it (returns (normed, sum))."""

    def __init__(
        self, hidden_size: int, eps: float, backend: KernelBackend, dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = replicated_weight_loader
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.backend.rms_norm(x, self.weight, self.eps, residual)


class SelfAttention(nn.Module):
    """QKV projection, (q/k norm,) rotary, paged attention over this rank's heads, output projection."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        backend: KernelBackend,
        o_proj_bias: bool,
        qk_norm: bool,
        dtype: torch.dtype | None,
    ):
        super().__init__()
        self.backend = backend
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            parallel,
            bias=config.attention_bias,
            dtype=dtype,
        )
        self.num_heads = self.qkv_proj.heads_per_rank
        self.num_kv_heads = self.qkv_proj.kv_heads_per_rank
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            parallel,
            bias=o_proj_bias,
            dtype=dtype,
        )
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, backend)
        # One [head_dim] weight shared by every head, so each rank holds all of it.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, backend, dtype) if qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, backend, dtype) if qk_norm else None

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]
        kv_cache: torch.Tensor,  # [2, kv_heads_per_rank, num_blocks, block_size, head_dim]
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32
    ) -> torch.Tensor:  # [num_tokens, hidden]
        num_tokens = hidden.shape[0]
        query, key, value = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.q_norm is not None:
            # Each head's vector is a row of the norm: [num_tokens * heads_per_rank, head_dim]; the
            # split's column slices are not viewable as that, so reshape copies them.
            query = self.q_norm(query.reshape(-1, self.head_dim))
            key = self.k_norm(key.reshape(-1, self.head_dim))
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        query, key = self.backend.rotary_embedding(positions, query, key, cos_sin_cache)
        out = self.attn(query, key, value, kv_cache, meta)  # [num_tokens, heads_per_rank, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """Gated SiLU MLP: down(silu(gate(x)) * up(x)), gate/up column-parallel, down row-parallel."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        backend: KernelBackend,
        dtype: torch.dtype | None,
    ):
        super().__init__()
        self.backend = backend
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], parallel, bias=config.mlp_bias, dtype=dtype
        )
        self.down_proj = RowParallelLinear(
            inter, config.hidden_size, parallel, bias=config.mlp_bias, dtype=dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> [num_tokens, hidden]
        return self.down_proj(self.backend.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        backend: KernelBackend,
        o_proj_bias: bool,
        qk_norm: bool,
        dtype: torch.dtype | None,
    ):
        super().__init__()
        self.self_attn = SelfAttention(config, parallel, backend, o_proj_bias, qk_norm, dtype)
        self.mlp = MLP(config, parallel, backend, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,  # [num_tokens, hidden]: the previous layer's output (not yet added)
        residual: torch.Tensor | None,  # [num_tokens, hidden]: the running residual stream
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm (Hugging Face's `model.` prefix)."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        backend: KernelBackend,
        o_proj_bias: bool,
        qk_norm: bool,
        dtype: torch.dtype | None,
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, parallel, backend, o_proj_bias, qk_norm, dtype)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, cos_sin_cache)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    """A decoder-only language model on one tensor-parallel rank.

    Parameters are created with torch.empty (uninitialised) on the current default device
    (build under `with torch.device(...)`) in `dtype`; engine/checkpoint/loader.py fills them.
    """

    # Llama's `attention_bias` covers q, k, v and o; Qwen2 has bias on q, k, v only.
    o_proj_follows_attention_bias = True
    # Qwen3 normalises each query and key head (self_attn.q_norm / k_norm) before rotary.
    qk_norm = False

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        backend: KernelBackend,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.config = config
        self.parallel = parallel
        self.backend = backend
        o_proj_bias = config.attention_bias and self.o_proj_follows_attention_bias
        self.model = DecoderModel(config, parallel, backend, o_proj_bias, self.qk_norm, dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel, dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Built once, in float32 whatever the weights' dtype; a buffer so it follows the device.
        self.register_buffer(
            "cos_sin_cache",
            rope_cos_sin_cache(
                config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
            ),
            persistent=False,
        )  # [max_position_embeddings, head_dim]; cover_positions may grow it

    def cover_positions(self, max_model_len: int) -> None:
        """Grow the rotary table to max_model_len rows where a rope-scaled context passes
        max_position_embeddings (a position past the table would index outside it)."""
        config = self.config
        if self.cos_sin_cache.shape[0] < max_model_len:
            self.cos_sin_cache = rope_cos_sin_cache(
                config.head_dim, max_model_len, config.rope_theta, config.rope_scaling
            ).to(self.cos_sin_cache.device)

    @property
    def kv_heads_per_rank(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],  # per layer [2, kv_heads_per_rank, num_blocks, block_size, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return self.model(input_ids, positions, kv_caches, meta, self.cos_sin_cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab_size] float32, the full vocabulary on every rank."""
        return self.lm_head(hidden).float()


class LlamaForCausalLM(CausalLM):
    """Llama 2/3 and Mistral (without sliding-window attention)."""
