"""SiLU-and-multiply in Triton. Same contract as `silu_and_mul_torch` (kernels/activation.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [num_tokens, d]
    x_ptr,  # [num_tokens, 2 * d] (gate || up)
    d,
    stride_out,
    stride_x,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < d
    row = x_ptr + token * stride_x
    gate = tl.load(row + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + d + col, mask=mask, other=0.0).to(tl.float32)
    # Rounded to the input dtype before the product, as F.silu(gate) * up does.
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + token * stride_out + col, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * d] (gate || up) -> [num_tokens, d] = silu(gate) * up."""
    d = x.shape[-1] // 2
    x2d = x.reshape(-1, 2 * d)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    num_tokens = x2d.shape[0]
    if num_tokens:
        out2d = out.view(-1, d)
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](
            out2d, x2d, d, out2d.stride(0), x2d.stride(0), BLOCK=block
        )
    return out
