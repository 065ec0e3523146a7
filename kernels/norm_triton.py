"""RMSNorm in Triton, optionally fused with the residual add before it. Same contract as
`rms_norm_torch` (kernels/norm.py), including its rounding: the sum x + residual is rounded to the
input dtype before it is normalised, and the normalised value is rounded before the weight multiplies."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_tokens, hidden]
    residual_out_ptr,  # [num_tokens, hidden] x + residual (only with HAS_RESIDUAL)
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden] (only with HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    eps,
    stride_out,
    stride_residual_out,
    stride_x,
    stride_residual,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    mask = col < HIDDEN
    x = tl.load(x_ptr + token * stride_x + col, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + token * stride_residual + col, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + token * stride_residual_out + col, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / HIDDEN + eps)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_out + col, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * x / rms(x); with `residual`, normalise x + residual and also return that sum."""
    hidden = x.shape[-1]
    x2d = x.reshape(-1, hidden)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    num_tokens = x2d.shape[0]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else None
    if num_tokens:
        residual2d = residual.reshape(-1, hidden).contiguous() if residual is not None else x2d
        residual_out2d = residual_out.view(-1, hidden) if residual is not None else x2d
        out2d = out.view(-1, hidden)
        _rms_norm_kernel[(num_tokens,)](
            out2d,
            residual_out2d,
            x2d,
            residual2d,
            weight,
            eps,
            out2d.stride(0),
            residual_out2d.stride(0),
            x2d.stride(0),
            residual2d.stride(0),
            HIDDEN=hidden,
            BLOCK=triton.next_power_of_2(hidden),
            HAS_RESIDUAL=residual is not None,
            num_warps=4 if hidden <= 4096 else 8,
        )
    return out if residual is None else (out, residual_out)
