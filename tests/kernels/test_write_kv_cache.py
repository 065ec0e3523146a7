"""Writing this step's K/V into the paged cache: each token lands in its slot; padding (-1) goes nowhere."""

import pytest
import torch

pytestmark = pytest.mark.usefixtures("poisoned_allocations")


@pytest.mark.parametrize(
    "block_size, head_dim, num_kv_heads, dtype",
    [
        (16, 64, 1, torch.float32),
        (32, 128, 2, torch.bfloat16),
        (16, 128, 4, torch.float32),
        (32, 64, 3, torch.bfloat16),
    ],
)
def test_each_token_lands_in_its_slot_and_nothing_else_changes(
    backend, block_size, head_dim, num_kv_heads, dtype
):
    generator = torch.Generator().manual_seed(block_size + head_dim + num_kv_heads)
    num_blocks, num_tokens = 6, 13
    kv_cache = torch.full((2, num_kv_heads, num_blocks, block_size, head_dim), float("nan"), dtype=dtype)
    # Slots anywhere in the cache, out of order; two tokens are padding.
    slot_mapping = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slot_mapping[[3, 9]] = -1
    # Views into a fused QKV-like buffer, as the attention layer passes them: not contiguous.
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=generator).to(dtype)
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads : 2 * num_kv_heads]

    backend.write_kv_cache(key, value, kv_cache, slot_mapping)

    flat = kv_cache.view(2, num_kv_heads, num_blocks * block_size, head_dim)
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            assert torch.equal(flat[0, :, slot], key[token])
            assert torch.equal(flat[1, :, slot], value[token])
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slot_mapping[slot_mapping >= 0]] = True
    assert flat[:, :, ~written].isnan().all(), "a slot outside slot_mapping was written"
    assert not flat[:, :, written].isnan().any()


def test_a_slot_outside_the_cache_is_refused_by_the_native_kernel(native):
    kv_cache = torch.zeros(2, 1, 2, 16, 64)
    key = value = torch.ones(2, 1, 64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        native.write_kv_cache(key, value, kv_cache, torch.tensor([3, 32]))
    assert not kv_cache.any(), "nothing is written when a slot is refused"
