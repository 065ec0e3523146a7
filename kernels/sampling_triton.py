"""Token selection in Triton: kernels/sampling.py's contract, one program per row.

top-k and top-p thresholds are found by bisection over the logits' order-preserving int32 keys (32
passes over the row at most, no sort): the largest key K such that the tokens at or above K hold
enough (count for top-k, probability mass for top-p). Masses and the draw's running sum are float64.

On a GPU a row's program is 8 warps over blocks of 2048 tokens: 8 tokens per thread, whose float64
masses fit in registers (blocks of 4096 at 4 warps spilled on sm_90, scripts/gpu_check.py --compile-only).
Keys stay int32; only the bisection's midpoint is computed in int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_launch import is_interpreter

BLOCK, NUM_WARPS = 2048, 8  # tokens per loop iteration, warps per row (GPU)


@triton.jit
def _order_key(x):
    """int32 keys in the floats' order (not NaN): negative floats flip their magnitude bits."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _kept_probs(x, valid, key, row_max, inv_temperature, floor_key, min_p):
    """exp((x - max) / T) for the tokens at or above floor_key with at least min_p, else 0 (float64)."""
    e = tl.exp((x - row_max) * inv_temperature)
    keep = valid & (key >= floor_key) & (e >= min_p)
    return tl.where(keep, e, 0.0).to(tl.float64)


@triton.jit
def _bisect_threshold(
    base, row_max, inv_temperature, floor_key, target, BY_MASS: tl.constexpr, VOCAB: tl.constexpr, BLOCK: tl.constexpr
):
    """The largest key K >= floor_key whose tokens at or above it weigh >= target (count or mass)."""
    offs = tl.arange(0, BLOCK)
    lo = floor_key.to(tl.int64)
    hi = _order_key(row_max).to(tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2  # int64: hi - lo may pass 2**31
        mid32 = mid.to(tl.int32)  # lo <= mid <= hi, both int32 keys
        weight = tl.zeros((), dtype=tl.float64)
        for start in range(0, VOCAB, BLOCK):
            valid = start + offs < VOCAB
            x = tl.load(base + start + offs, mask=valid, other=float("-inf"))
            key = _order_key(x)
            if BY_MASS:
                w = _kept_probs(x, valid, key, row_max, inv_temperature, floor_key, 0.0)
            else:
                w = tl.where(valid & (key >= floor_key), 1.0, 0.0).to(tl.float64)
            weight += tl.sum(tl.where(key >= mid32, w, 0.0), axis=0)
        enough = weight >= target
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    return lo.to(tl.int32)


@triton.jit
def _sample_kernel(
    out_ptr,  # [num_rows] int64
    logits_ptr,  # [num_rows, vocab] float32
    temperature_ptr,  # [num_rows] float32
    top_k_ptr,  # [num_rows] int32
    top_p_ptr,  # [num_rows] float32
    min_p_ptr,  # [num_rows] float32
    uniforms_ptr,  # [num_rows] float64
    stride_row,
    VOCAB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK)
    row_max = tl.full((), float("-inf"), tl.float32)
    for start in range(0, VOCAB, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < VOCAB, other=float("-inf"))
        row_max = tl.maximum(row_max, tl.max(x, axis=0))
    temperature = tl.load(temperature_ptr + row)
    if temperature == 0.0:
        chosen = tl.full((), VOCAB, tl.int32)
        for start in range(0, VOCAB, BLOCK):
            valid = start + offs < VOCAB
            x = tl.load(base + start + offs, mask=valid, other=float("-inf"))
            chosen = tl.minimum(chosen, tl.min(tl.where(valid & (x == row_max), start + offs, VOCAB), axis=0))
        tl.store(out_ptr + row, tl.where(chosen < VOCAB, chosen, 0).to(tl.int64))
    else:
        inv_temperature = 1.0 / temperature
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        min_p = tl.load(min_p_ptr + row)
        floor_key = tl.full((), -(2**31), tl.int32)
        if (top_k > 0) & (top_k < VOCAB):
            floor_key = _bisect_threshold(
                base, row_max, inv_temperature, floor_key, top_k.to(tl.float64), False, VOCAB, BLOCK
            )
        if top_p < 1.0:
            total = tl.zeros((), dtype=tl.float64)
            for start in range(0, VOCAB, BLOCK):
                valid = start + offs < VOCAB
                x = tl.load(base + start + offs, mask=valid, other=float("-inf"))
                e = _kept_probs(x, valid, _order_key(x), row_max, inv_temperature, floor_key, 0.0)
                total += tl.sum(e, axis=0)
            floor_key = _bisect_threshold(
                base, row_max, inv_temperature, floor_key, top_p.to(tl.float64) * total, True, VOCAB, BLOCK
            )
        total = tl.zeros((), dtype=tl.float64)
        for start in range(0, VOCAB, BLOCK):
            valid = start + offs < VOCAB
            x = tl.load(base + start + offs, mask=valid, other=float("-inf"))
            e = _kept_probs(x, valid, _order_key(x), row_max, inv_temperature, floor_key, min_p)
            total += tl.sum(e, axis=0)
        target = tl.load(uniforms_ptr + row) * total
        running = tl.zeros((), dtype=tl.float64)
        chosen = tl.full((), VOCAB, tl.int32)
        last_kept = tl.full((), -1, tl.int32)
        for start in range(0, VOCAB, BLOCK):
            valid = start + offs < VOCAB
            x = tl.load(base + start + offs, mask=valid, other=float("-inf"))
            e = _kept_probs(x, valid, _order_key(x), row_max, inv_temperature, floor_key, min_p)
            cumulative = running + tl.cumsum(e, axis=0)
            # blocks come in order: the first block with a crossing holds the smallest index
            chosen = tl.minimum(chosen, tl.min(tl.where((cumulative > target) & (e > 0), start + offs, VOCAB), axis=0))
            last_kept = tl.maximum(last_kept, tl.max(tl.where(e > 0, start + offs, -1), axis=0))
            running += tl.sum(e, axis=0)
        tl.store(out_ptr + row, tl.where(chosen < VOCAB, chosen, last_kept).to(tl.int64))


def sample_tokens_triton(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    temperature: torch.Tensor,  # [num_rows] float32
    top_k: torch.Tensor,  # [num_rows] int32
    top_p: torch.Tensor,  # [num_rows] float32
    min_p: torch.Tensor,  # [num_rows] float32
    uniforms: torch.Tensor,  # [num_rows] float64
) -> torch.Tensor:
    """[num_rows] int64 token ids; same contract as `sample_tokens_torch`."""
    num_rows, vocab = logits.shape
    logits = logits.float().contiguous()
    device = logits.device
    out = torch.empty(num_rows, dtype=torch.int64, device=device)
    if num_rows == 0:
        return out
    block = min(triton.next_power_of_2(vocab), 64 if is_interpreter(device) else BLOCK)
    _sample_kernel[(num_rows,)](
        out,
        logits,
        temperature.to(device=device, dtype=torch.float32).contiguous(),
        top_k.to(device=device, dtype=torch.int32).contiguous(),
        top_p.to(device=device, dtype=torch.float32).contiguous(),
        min_p.to(device=device, dtype=torch.float32).contiguous(),
        uniforms.to(device=device, dtype=torch.float64).contiguous(),
        logits.stride(0),
        VOCAB=vocab,
        BLOCK=block,
        num_warps=NUM_WARPS,
    )
    return out
