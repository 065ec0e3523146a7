"""SiLU-and-multiply, the gated MLP's activation: silu(gate) * up over (gate || up)."""

import pytest
import torch
from kernel_float64_spec import assert_close_to_spec, silu_and_mul

pytestmark = pytest.mark.usefixtures("poisoned_allocations")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 100, 1408])
def test_silu_and_mul_matches_float64_spec(backend, d, dtype):
    generator = torch.Generator().manual_seed(d)
    x = (2 * torch.randn(5, 2 * d, generator=generator)).to(dtype)

    out = backend.silu_and_mul(x)

    assert out.dtype == dtype
    assert_close_to_spec(out, silu_and_mul(x), dtype)


def test_gates_far_below_zero_give_zero_not_nan(backend):
    """silu(g) for g < -88: exp(-g) overflows float32, and a vectorised g / (1 + inf) must still be ~0."""
    gates = torch.tensor([-89.0, -100.0, -1e4, -3e38, -88.0, -87.0, 5.0, 88.0] * 4 + [-1e4, -100.0, 1.0, -89.0])
    x = torch.cat([gates, torch.full((36,), 2.0)]).repeat(3, 1)  # [3, 2 * 36]: whole vectors and a scalar tail

    out = backend.silu_and_mul(x)

    assert_close_to_spec(out, silu_and_mul(x), torch.float32)

