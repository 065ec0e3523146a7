"""scripts/bench_spec_decode.py's output lengths (the load itself runs the demo model: not part of make test)."""

from scripts.bench_spec_decode import output_lengths


def test_output_lengths_are_fixed_or_drawn_within_the_range_the_same_for_a_seed():
    assert output_lengths(5, 128, 0.0) == [128] * 5
    drawn = output_lengths(400, 128, 0.5)
    assert min(drawn) >= 64 and max(drawn) <= 192 and len(set(drawn)) > 50
    assert output_lengths(400, 128, 0.5) == drawn and output_lengths(400, 128, 0.5, seed=1) != drawn
    assert min(output_lengths(50, 2, 0.9)) >= 1
