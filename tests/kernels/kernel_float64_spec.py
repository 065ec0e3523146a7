"""Each kernel's meaning, written the slow and obvious way in float64: the oracle for both backends."""

from __future__ import annotations

import math

import torch

# Largest |out - float64 spec| / max |float64 spec| allowed per dtype.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def assert_close_to_spec(out: torch.Tensor, spec: torch.Tensor, dtype: torch.dtype) -> None:
    """Relative error against the float64 spec, over the whole tensor; NaN anywhere fails."""
    assert out.shape == spec.shape, (out.shape, spec.shape)
    assert not out.isnan().any(), f"{int(out.isnan().sum())} elements are NaN (never written?)"
    error = (out.double() - spec).abs().max() / spec.abs().max()
    assert error <= TOLERANCE[dtype], f"relative error {error:.2e} > {TOLERANCE[dtype]:.0e} for {dtype}"


def paged_keys_values(kv_cache, block_table, context_len: int, kv_head: int):
    """The first context_len tokens of one sequence's K and V for one KV head: [context_len, head_dim] each."""
    block_size = kv_cache.shape[3]
    positions = torch.arange(context_len)
    blocks = block_table.long()[positions // block_size]
    offsets = positions % block_size
    key = kv_cache[0, kv_head, blocks, offsets].double()
    value = kv_cache[1, kv_head, blocks, offsets].double()
    return key, value


def attend(query_row, key, value, scale: float):
    """softmax(q . k * scale) @ v for one query vector."""
    weights = torch.softmax((key @ query_row.double()) * scale, dim=0)
    return weights @ value


def decode_attention(query, kv_cache, block_tables, context_lens, scale):
    num_seqs, num_heads, head_dim = query.shape
    group = num_heads // kv_cache.shape[1]
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float64)
    for seq in range(num_seqs):
        for head in range(num_heads):
            key, value = paged_keys_values(kv_cache, block_tables[seq], int(context_lens[seq]), head // group)
            out[seq, head] = attend(query[seq, head], key, value, scale)
    return out


def prefill_attention(query, kv_cache, block_tables, query_start_loc, context_lens, scale):
    num_tokens, num_heads, head_dim = query.shape
    group = num_heads // kv_cache.shape[1]
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float64)
    for seq in range(block_tables.shape[0]):
        start, end = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
        context_len = int(context_lens[seq])
        # The chunk is the context's last (end - start) positions; each sees keys up to its own.
        query_positions = torch.arange(context_len - (end - start), context_len)
        hidden = torch.arange(context_len)[None, :] > query_positions[:, None]  # [chunk, context]
        for head in range(num_heads):
            key, value = paged_keys_values(kv_cache, block_tables[seq], context_len, head // group)
            scores = (query[start:end, head].double() @ key.T) * scale
            out[start:end, head] = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ value
    return out


def rms_norm(x, weight, eps, residual=None):
    x = x.double() if residual is None else x.double() + residual.double()
    return weight.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps), x


def llama3_inv_freq(head_dim: int, theta: float, scaling: dict | None):
    """Llama 3.1's frequency-dependent RoPE scaling, as its paper describes it (no scaling if None)."""
    inv_freq = [theta ** (-2 * i / head_dim) for i in range(head_dim // 2)]
    if scaling is None:
        return torch.tensor(inv_freq, dtype=torch.float64)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    scaled = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            scaled.append(freq)
        elif wavelen > old_len / low:
            scaled.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            scaled.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(scaled, dtype=torch.float64)


def rotary_embedding(positions, x, inv_freq):
    """Rotate each (x[i], x[i + half]) pair of every head by position * inv_freq[i]."""
    angle = positions.double()[:, None, None] * inv_freq[None, None, :]  # [tokens, 1, half]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], dim=-1)


def silu_and_mul(x):
    gate, up = x.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def sample_tokens(logits, temperature, top_k, top_p, min_p, uniforms) -> list[int]:
    """kernels/sampling.py's contract, one token at a time in float64 Python."""
    out = []
    for row, x in enumerate(logits.double().tolist()):
        vocab = len(x)
        t = float(temperature[row])
        if t == 0.0:
            out.append(max(range(vocab), key=lambda i: (x[i], -i)))  # the first of equal maxima
            continue
        descending = sorted(range(vocab), key=lambda i: -x[i])
        kept = [True] * vocab
        k = int(top_k[row])
        if 0 < k < vocab:
            kth = x[descending[k - 1]]
            kept = [x[i] >= kth for i in range(vocab)]
        largest = max(x)
        e = [math.exp((x[i] - largest) / t) if kept[i] else 0.0 for i in range(vocab)]
        p = float(top_p[row])
        if p < 1.0:
            target, mass = p * sum(e), 0.0
            for i in descending:
                mass += e[i]
                if mass >= target:
                    kept = [kept[j] and x[j] >= x[i] for j in range(vocab)]
                    break
        kept = [kept[i] and e[i] >= float(min_p[row]) for i in range(vocab)]
        probs = [e[i] if kept[i] else 0.0 for i in range(vocab)]
        target, running = float(uniforms[row]) * sum(probs), 0.0
        chosen = max(i for i in range(vocab) if kept[i])
        for i in range(vocab):
            running += probs[i]
            if running > target:
                chosen = i
                break
        out.append(chosen)
    return out
