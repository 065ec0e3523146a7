"""RMSNorm, optionally fused with the residual add that precedes it."""

import torch


def rms_norm_torch(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * x / rms(x), in float32 internally; with `residual`, first x += residual and also
    return the sum (the next layer's residual): (normed, x + residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(x.dtype)
    return out if residual is None else (out, residual)
