"""The structured-output mask (kernels/bitmask.py's contract): every backend masks exactly the cleared bits,
and no backend's sampler then draws a masked token, whatever its filters."""

import pytest
import torch

from kernels.bitmask import apply_token_bitmask_torch, bitmask_words
from kernels.sampling import counter_uniforms


def random_bitmask(num_rows: int, vocab: int, allowed_fraction: float, seed: int) -> torch.Tensor:
    """[num_rows, words] int32 with about `allowed_fraction` of the tokens allowed, and some all-ones words."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.rand(num_rows, bitmask_words(vocab) * 32, generator=generator) < allowed_fraction
    allowed[:, :64] = True  # whole words of ones: the native kernel's skip
    weights = (1 << torch.arange(32, dtype=torch.int64))
    words = (allowed.view(num_rows, -1, 32).long() * weights).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def allowed_tokens(bitmask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (bitmask_row[:, None].long() >> torch.arange(32)) & 1
    return bits.flatten()[:vocab].bool()


@pytest.mark.parametrize("vocab", [100, 1000, 1031])  # not a multiple of 32: the last word is partial
def test_every_backend_masks_exactly_the_cleared_bits_of_the_named_rows(backend, vocab):
    num_rows = 6
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(vocab))
    rows = torch.tensor([4, 0, 2], dtype=torch.int64)  # rows 1, 3 and 5 are unconstrained
    bitmask = random_bitmask(len(rows), vocab, 0.3, seed=vocab)
    expected = logits.clone()
    apply_token_bitmask_torch(expected, bitmask, rows)
    got = logits.clone()
    backend.apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, expected)
    for i, row in enumerate(rows.tolist()):
        allowed = allowed_tokens(bitmask[i], vocab)
        assert torch.isinf(got[row][~allowed]).all() and torch.equal(got[row][allowed], logits[row][allowed])
    for row in (1, 3, 5):
        assert torch.equal(got[row], logits[row])


def test_no_backend_samples_a_masked_token_whatever_its_filters(backend):
    vocab, num_rows = (128, 8) if backend.name == "triton" else (2000, 32)
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(1)) * 3
    bitmask = random_bitmask(num_rows, vocab, 0.02, seed=2)  # few allowed: top-k larger than what is left
    bitmask[:, :2] = 0  # none of the first 64 tokens
    bitmask[:, 2] |= 1 << (torch.arange(num_rows, dtype=torch.int32) % 31)  # but at least one token a row
    rows = torch.arange(num_rows)
    backend.apply_token_bitmask(logits, bitmask, rows)
    params = [(1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (0.8, 500, 1.0, 0.0), (1.2, 0, 0.5, 0.0), (1.0, 0, 1.0, 0.2),
              (1.0, 300, 0.9, 0.05), (2.0, 1, 1.0, 0.0), (0.5, 1000, 0.99, 0.0)]
    temperature = torch.tensor([params[r % 8][0] for r in range(num_rows)])
    top_k = torch.tensor([params[r % 8][1] for r in range(num_rows)], dtype=torch.int32)
    top_p = torch.tensor([params[r % 8][2] for r in range(num_rows)])
    min_p = torch.tensor([params[r % 8][3] for r in range(num_rows)])
    for position in range(4):
        uniforms = counter_uniforms(list(range(num_rows)), [position] * num_rows)
        # the draw's edge: a uniform of ~1 lands at the very end of the running mass
        uniforms[0] = 1.0 - 2**-53
        tokens = backend.sample_tokens(logits, temperature, top_k, top_p, min_p, uniforms)
        for row, token in enumerate(tokens.tolist()):
            assert allowed_tokens(bitmask[row], vocab)[token], (row, token)
