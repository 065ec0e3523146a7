"""Rotary position embedding (Llama / GPT-NeoX style: rotate the two halves of each head)."""

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None = None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with Llama 3's frequency-dependent scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not rope_scaling:
        return inv_freq
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / rope_scaling["factor"]
    if kind == "freq_factors":  # GGUF's rope_freqs tensor: Llama 3's scaling, already worked out per frequency
        return inv_freq / torch.tensor(rope_scaling["factors"], dtype=torch.float32)
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3, freq_factors)")
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin_cache(
    head_dim: int, max_position: int, theta: float, rope_scaling: dict | None = None
) -> torch.Tensor:
    """[max_position, head_dim] float32: cos of each frequency in the first half, sin in the second."""
    inv_freq = rope_inv_freq(head_dim, theta, rope_scaling)
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rotary_embedding_torch(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32 (cos || sin)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key by their positions; returns new (query, key) in their input dtype."""
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions)  # [num_tokens, head_dim]
    cos = cos_sin[:, None, :half].to(query.dtype)
    sin = cos_sin[:, None, half:].to(query.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    return rotate(query), rotate(key)
