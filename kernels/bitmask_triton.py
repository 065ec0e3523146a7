"""The structured-output mask in Triton: kernels/bitmask.py's contract, one program per (masked row, block)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_launch import is_interpreter


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr,  # [num_rows, vocab] float32
    bitmask_ptr,  # [num_masked, words] int32
    rows_ptr,  # [num_masked] int64
    vocab,
    words,
    logits_stride,
    BLOCK: tl.constexpr,  # tokens per program, a multiple of 32
):
    masked = tl.program_id(0)
    block = tl.program_id(1)
    row = tl.load(rows_ptr + masked)
    tokens = block * BLOCK + tl.arange(0, BLOCK)
    valid = tokens < vocab
    word = tl.load(bitmask_ptr + masked * words + tokens // 32, mask=valid, other=-1)
    allowed = ((word >> (tokens % 32)) & 1) != 0
    tl.store(logits_ptr + row * logits_stride + tokens, float("-inf"), mask=valid & ~allowed)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: -inf where the bitmask clears a token (see kernels/bitmask.py)."""
    num_masked = rows.numel()
    if num_masked == 0:
        return
    vocab = logits.shape[1]
    block = 256 if is_interpreter(logits.device) else 1024
    bitmask = bitmask.to(device=logits.device, dtype=torch.int32).contiguous()
    rows = rows.to(device=logits.device, dtype=torch.int64).contiguous()
    grid = (num_masked, triton.cdiv(vocab, block))
    _apply_bitmask_kernel[grid](logits, bitmask, rows, vocab, bitmask.shape[1], logits.stride(0), BLOCK=block)
