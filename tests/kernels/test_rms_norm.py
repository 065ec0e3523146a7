"""RMSNorm, alone and fused with the residual add that precedes it."""

import pytest
import torch
from kernel_float64_spec import assert_close_to_spec, rms_norm

pytestmark = pytest.mark.usefixtures("poisoned_allocations")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 96, 512])
def test_rms_norm_matches_float64_spec(backend, hidden, dtype):
    generator = torch.Generator().manual_seed(hidden)
    x = (3 * torch.randn(7, hidden, generator=generator)).to(dtype)
    weight = (1 + 0.5 * torch.randn(hidden, generator=generator)).to(dtype)

    out = backend.rms_norm(x, weight, 1e-6)

    assert out.dtype == dtype
    assert_close_to_spec(out, rms_norm(x, weight, 1e-6)[0], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 96])
def test_fused_residual_returns_the_normed_sum_and_the_sum(backend, hidden, dtype):
    generator = torch.Generator().manual_seed(hidden + 1)
    x = torch.randn(5, hidden, generator=generator).to(dtype)
    residual = torch.randn(5, hidden, generator=generator).to(dtype)
    weight = (1 + 0.5 * torch.randn(hidden, generator=generator)).to(dtype)
    x_before, residual_before = x.clone(), residual.clone()

    out, new_residual = backend.rms_norm(x, weight, 1e-5, residual=residual)

    spec_out, spec_sum = rms_norm(x, weight, 1e-5, residual)
    assert_close_to_spec(out, spec_out, dtype)
    assert_close_to_spec(new_residual, spec_sum, dtype)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs must not change"
