"""oneDNN's packed products run on row-count buckets above EXACT_ROWS_MAX rows (kernels/linear.py padded_rows)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kernels import linear as linear_module
from kernels.linear import EXACT_ROWS_MAX, PackedLinearWeight, padded_rows
from tests.parallel.test_packed_weights import onednn_packs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


PACKED_DTYPES = [dtype for dtype in (torch.float32, torch.bfloat16) if onednn_packs(dtype)]


def record_row_counts(monkeypatch) -> list[int]:
    """The row count of every packed product from here on (kernels/linear.py onednn_linear)."""
    product = linear_module.onednn_linear
    seen: list[int] = []

    def recording(x, packed, bias):
        seen.append(x.shape[0])
        return product(x, packed, bias)

    monkeypatch.setattr(linear_module, "onednn_linear", recording)
    return seen


def test_rows_up_to_the_limit_stay_as_they_are():
    assert [padded_rows(rows) for rows in range(1, EXACT_ROWS_MAX + 1)] == list(range(1, EXACT_ROWS_MAX + 1))


def test_buckets_add_at_most_a_sixteenth_and_number_sixteen_per_doubling():
    for rows in range(EXACT_ROWS_MAX + 1, 8193):
        padded = padded_rows(rows)
        assert rows <= padded <= rows + rows / 16, rows
        assert padded_rows(padded) == padded  # a bucket is its own bucket
    for low in (256, 512, 1024, 2048, 4096):
        assert len({padded_rows(rows) for rows in range(low + 1, 2 * low + 1)}) == 16
    assert [padded_rows(rows) for rows in (257, 300, 500, 512, 513, 2000)] == [272, 304, 512, 512, 544, 2048]


def test_buckets_turned_off_leave_every_row_count_as_it_is(monkeypatch):
    monkeypatch.setattr(linear_module, "ROW_BUCKETS", False)
    assert padded_rows(300) == 300 and padded_rows(2000) == 2000


def test_the_environment_variable_turns_buckets_off():
    code = "from kernels.linear import padded_rows; print(padded_rows(300), padded_rows(2000))"
    for value, expected in (("0", "300 2000"), ("1", "304 2048")):
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                              env={**os.environ, "SHARDSERVE_LINEAR_ROW_BUCKETS": value})
        assert done.stdout.split() == expected.split()


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("rows", [1, EXACT_ROWS_MAX, EXACT_ROWS_MAX + 1, 300, 513])
def test_padded_product_returns_the_rows_asked_for(rows, dtype, monkeypatch):
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 64).to(dtype), torch.randn(96).to(dtype)
    packed = PackedLinearWeight(weight)
    seen = record_row_counts(monkeypatch)
    x = torch.randn(rows, 64).to(dtype) * 4  # far from zero, so padding rows' results would show if returned
    out = packed.matmul(x, bias)
    assert seen == [padded_rows(rows)]
    assert out.shape == (rows, 96)
    reference = F.linear(x.double(), weight.double(), bias.double())
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.double(), reference, rtol=tolerance, atol=tolerance * 8)
    monkeypatch.setattr(linear_module, "ROW_BUCKETS", False)
    exact = packed.matmul(x, bias)  # the same rows without padding
    assert seen[-1] == rows
    torch.testing.assert_close(out, exact, rtol=tolerance, atol=tolerance)


def test_the_benchmark_measures_buckets_off_and_on_each_in_a_process_of_its_own(tiny_llama_dir, capsys):
    from scripts.bench_row_buckets import main

    main(["--model", str(tiny_llama_dir), "--prompts", "3", "--min-tokens", "300", "--max-tokens", "320",
          "--load-prompts", "2", "--load-concurrency", "2", "--rounds", "1"])
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith(("| off", "| on"))]
    # the products table, then the engine's: each with buckets off, then on (each child checked what it ran with)
    assert [row[0].strip() for row in rows] == ["off", "on", "off", "on"]
    assert all(float(cell) > 0 for row in rows for cell in row[1:])
