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
