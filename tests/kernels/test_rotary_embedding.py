"""Rotary position embedding (NeoX / Llama halves), with Llama 3 scaling carried by the cos/sin cache."""

import pytest
import torch
from kernel_float64_spec import assert_close_to_spec, llama3_inv_freq, rotary_embedding

from kernels.rotary import rope_cos_sin_cache

pytestmark = pytest.mark.usefixtures("poisoned_allocations")

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so all three frequency bands occur at head_dim 64
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("rope_scaling", [None, LLAMA3], ids=["plain", "llama3"])
def test_rotary_matches_float64_spec(backend, head_dim, rope_scaling, dtype):
    generator = torch.Generator().manual_seed(head_dim)
    theta, num_heads, num_kv_heads = 10000.0, 4, 2
    cos_sin_cache = rope_cos_sin_cache(head_dim, 300, theta, rope_scaling)
    positions = torch.tensor([0, 1, 17, 255, 3, 299])  # out of order, as a mixed batch has them
    # Query and key as views of one fused QKV buffer: neither is contiguous.
    fused = torch.randn(6, num_heads + 2 * num_kv_heads, head_dim, generator=generator).to(dtype)
    query, key = fused[:, :num_heads], fused[:, num_heads : num_heads + num_kv_heads]

    new_query, new_key = backend.rotary_embedding(positions, query, key, cos_sin_cache)

    inv_freq = llama3_inv_freq(head_dim, theta, rope_scaling)
    assert new_query.dtype == dtype and new_key.dtype == dtype
    assert_close_to_spec(new_query, rotary_embedding(positions, query, inv_freq), dtype)
    assert_close_to_spec(new_key, rotary_embedding(positions, key, inv_freq), dtype)


def test_triton_rotary_never_reads_past_the_table():
    """A position past the cos/sin table must not read the memory after it (the torch path raises there;
    the Triton kernel cannot, so it reads nothing and that token's q and k come out zero)."""
    from kernels.backend import get_backend

    head_dim, rows = 64, 8
    memory = torch.full((2 * rows, head_dim), float("nan"))  # what lies after the table: NaN
    memory[:rows] = rope_cos_sin_cache(head_dim, rows, 10000.0)
    table = memory[:rows]
    query, key = torch.ones(2, 2, head_dim), torch.ones(2, 1, head_dim)

    new_query, new_key = get_backend("triton", "cpu").rotary_embedding(torch.tensor([3, rows]), query, key, table)

    assert torch.isfinite(new_query).all() and torch.isfinite(new_key).all()
    assert new_query[1].abs().sum() == 0 and new_key[1].abs().sum() == 0
    want_query, _ = get_backend("torch").rotary_embedding(torch.tensor([3]), query[:1], key[:1], table)
    torch.testing.assert_close(new_query[:1], want_query)
