"""SiLU-and-multiply: the gated MLP's activation."""

import torch
import torch.nn.functional as F


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * d] (gate || up) -> [num_tokens, d] = silu(gate) * up."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
