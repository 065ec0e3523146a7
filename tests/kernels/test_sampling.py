"""Token selection (kernels/sampling.py's contract): every backend draws what the float64 spec draws,
and the draws follow the filtered softmax."""

import math

import pytest
import torch
from kernel_float64_spec import sample_tokens as sample_tokens_spec
from native_builds import NATIVE_BACKENDS

from kernels.sampling import counter_uniforms, sequence_seed

# (temperature, top_k, top_p, min_p) per row, cycled over the batch
ROW_PARAMS = [
    (0.0, 0, 1.0, 0.0),  # greedy
    (1.0, 0, 1.0, 0.0),  # plain sampling, what vLLM's client sends
    (0.7, 20, 1.0, 0.0),
    (1.0, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.05),
    (1.3, 50, 0.9, 0.02),
    (0.5, 0, 0.95, 0.1),
    (1.0, 1, 1.0, 0.0),  # top-k 1 keeps the maximum (and its ties)
    (0.9, 2000, 1.0, 0.0),  # a large top-k (the native op's radix selection, not its few-candidates path)
    (1.0, 1500, 0.7, 0.01),
]


def batch(num_rows: int, vocab: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    # a coarse grid makes ties, so the threshold rules (ties stay) are exercised
    logits = torch.round(3 * torch.randn(num_rows, vocab, generator=generator) * 8) / 8
    params = [ROW_PARAMS[row % len(ROW_PARAMS)] for row in range(num_rows)]
    temperature = torch.tensor([p[0] for p in params], dtype=torch.float32)
    top_k = torch.tensor([p[1] for p in params], dtype=torch.int32)
    top_p = torch.tensor([p[2] for p in params], dtype=torch.float32)
    min_p = torch.tensor([p[3] for p in params], dtype=torch.float32)
    uniforms = counter_uniforms([seed] * num_rows, list(range(num_rows)))
    return logits, temperature, top_k, top_p, min_p, uniforms


def test_every_backend_draws_what_the_float64_spec_draws(backend):
    # the interpreter runs Triton programs one at a time in numpy: keep its rows short
    vocab, num_rows = (100, 16) if backend.name == "triton" else (5000, 48)
    inputs = batch(num_rows, vocab, seed=vocab)

    out = backend.sample_tokens(*inputs)

    assert out.dtype == torch.int64 and out.shape == (num_rows,)
    expected = sample_tokens_spec(*inputs)
    assert out.tolist() == expected
    assert len(set(expected)) > num_rows // 2  # the rows really draw different tokens


def test_greedy_rows_take_the_first_of_equal_maxima(backend):
    logits = torch.zeros(2, 40)
    logits[0, [7, 9, 30]] = 2.0
    logits[1, [0, 39]] = 1.0
    zeros = torch.zeros(2)
    out = backend.sample_tokens(
        logits, zeros, torch.zeros(2, dtype=torch.int32), torch.ones(2), zeros, counter_uniforms([1, 2], [0, 0])
    )
    assert out.tolist() == [7, 0]


def test_filters_never_let_a_token_outside_the_kept_set_through(backend):
    vocab, num_rows = 64, 24
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(1, vocab, generator=generator).repeat(num_rows, 1)
    ones = torch.ones(num_rows)
    top5 = set(logits[0].topk(5).indices.tolist())
    out = backend.sample_tokens(
        logits, ones, torch.full((num_rows,), 5, dtype=torch.int32), ones, torch.zeros(num_rows),
        counter_uniforms([11] * num_rows, list(range(num_rows))),
    )
    assert set(out.tolist()) <= top5 and len(set(out.tolist())) > 1


# chi-square critical values at significance 0.001, by degrees of freedom
CHI2_CRITICAL_0_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46}


@pytest.mark.parametrize("backend", ["torch", *NATIVE_BACKENDS], indirect=True)
def test_draws_follow_the_softmax_at_temperature_0_7_within_top_p_0_9(backend):
    logits = torch.tensor([[2.0, 1.6, 1.1, 0.9, 0.2, -0.5, -1.0, -3.0]])
    temperature, top_p, draws = 0.7, 0.9, 20000
    probs = torch.softmax(logits[0].double() / temperature, dim=0)
    # the nucleus: the smallest head of the sorted distribution holding top_p
    nucleus_size = int((probs.cumsum(0) < top_p).sum()) + 1
    kept = probs[:nucleus_size] / probs[:nucleus_size].sum()
    assert nucleus_size == 4  # the test's own premise: a nucleus that drops some tokens

    out = backend.sample_tokens(
        logits.repeat(draws, 1),
        torch.full((draws,), temperature),
        torch.zeros(draws, dtype=torch.int32),
        torch.full((draws,), top_p),
        torch.zeros(draws),
        counter_uniforms([2024] * draws, list(range(draws))),
    )

    counts = torch.bincount(out, minlength=8).double()
    assert counts[nucleus_size:].sum() == 0, "a token outside the nucleus was drawn"
    expected = kept * draws
    chi2 = float(((counts[:nucleus_size] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_CRITICAL_0_001[nucleus_size - 1], f"chi-square {chi2:.1f}: counts {counts.tolist()}"


def test_counter_uniforms_are_a_pure_function_of_seed_and_position():
    first = counter_uniforms([5, 5, 6], [0, 1, 0])
    assert first.tolist() == counter_uniforms([5, 5, 6], [0, 1, 0]).tolist()
    assert len(set(first.tolist())) == 3
    assert counter_uniforms([5], [1]).tolist() == first[1:2].tolist()  # the batch around it does not matter
    many = counter_uniforms(list(range(20000)), [7] * 20000)
    assert float(many.min()) > 0 and float(many.max()) < 1
    # mean 1/2 and variance 1/12 of a uniform, within 4 standard errors
    assert abs(float(many.mean()) - 0.5) < 4 * math.sqrt(1 / 12 / 20000)
    assert abs(float(many.var()) - 1 / 12) < 4 * math.sqrt(1 / 180 / 20000)


def test_each_choice_of_a_seeded_request_has_its_own_stream():
    assert len({sequence_seed(42, index) for index in range(4)}) == 4
    assert sequence_seed(42, 0) == sequence_seed(42, 0) != sequence_seed(43, 0)
    assert sequence_seed(-1, 0) == sequence_seed(2**64 - 1, 0)  # any Python int is a seed
