"""scripts/bench_sampler.py times every column on every shape (no timing is asserted)."""

from scripts.bench_sampler import COLUMNS, main


def test_every_sampler_column_is_timed_for_every_shape(capsys):
    main(["--vocab", "1000,3000", "--batches", "1,4", "--repeats", "1", "--calls", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows] == ["| 1 × 1000", "| 4 × 1000", "| 1 × 3000", "| 4 × 3000"]
    for row in rows:
        timings = [float(cell) for cell in row.strip("| ").split(" | ")[1:]]
        assert len(timings) == len(COLUMNS) and all(ms > 0 for ms in timings)
