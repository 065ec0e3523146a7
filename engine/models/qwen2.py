"""Qwen2: the Llama decoder with bias on q/k/v (not on o_proj), embeddings often tied."""

from __future__ import annotations

from engine.models.llama import CausalLM


class Qwen2ForCausalLM(CausalLM):
    """Qwen2 / Qwen2.5. `attention_bias` (true for Qwen2) puts bias on q, k and v only; a tied
    checkpoint has no lm_head.weight and the head shares the embedding's shard."""

    o_proj_follows_attention_bias = False
