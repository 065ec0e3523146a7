"""Qwen3 (dense): the Llama decoder with an RMSNorm on each query and key head before rotary."""

from __future__ import annotations

from engine.models.llama import CausalLM


class Qwen3ForCausalLM(CausalLM):
    """Qwen3. `self_attn.q_norm` / `k_norm` ([head_dim], rms_norm_eps) normalise every head after
    the q/k projection. Unlike Qwen2, no bias by default, and `attention_bias` puts it on o_proj too,
    as in Llama. `head_dim` is explicit in config.json and need not be hidden_size / num_attention_heads;
    small checkpoints tie their embeddings."""

    qk_norm = True
