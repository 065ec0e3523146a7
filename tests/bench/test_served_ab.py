"""scripts/bench_served_ab.py's arithmetic: ratios per round, medians, and the settings it names."""

from scripts.bench_served_ab import describe, environment, parse_args


def test_the_table_gives_each_rounds_ratio_and_the_median_of_the_ratios():
    args = parse_args(["--a", "--cpu-threads-bind none", "--b-env", "RAY_worker_niceness=0", "--prompts", "10"])
    table = describe(args, {"A": [100.0, 50.0, 80.0], "B": [110.0, 40.0, 80.0]})
    assert "| 0 | 100.0 | 110.0 | 1.100 |" in table and "| 1 | 50.0 | 40.0 | 0.800 |" in table
    # the median of the per-round ratios (1.0), not the ratio of the medians (80 / 80)
    assert "| median | 80.0 | 80.0 | 1.000 (range 0.800-1.100) |" in table
    assert "A: `--cpu-threads-bind none`, B: `RAY_worker_niceness=0`" in table and "10 prompts" in table


def test_environment_pairs_are_read_as_names_and_values():
    assert environment("RAY_worker_niceness=0 X='a b'") == {"RAY_worker_niceness": "0", "X": "a b"}
    assert environment("") is None
