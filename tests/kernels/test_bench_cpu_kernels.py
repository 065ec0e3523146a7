"""scripts/bench_cpu_kernels.py runs every case and reports both timings (no timing is asserted)."""

from scripts.bench_cpu_kernels import main


def test_every_op_is_timed_against_its_reference(capsys):
    main(["--repeats", "1", "--calls", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    labels = [row.split(" | ")[0] for row in rows]
    assert len(rows) == 16
    assert any("decode attention" in label for label in labels)
    assert any("prefill attention" in label for label in labels)
    assert any("verifications" in label for label in labels)
    assert any("linears" in label for label in labels)
    for row in rows:
        ref, native = (float(cell) for cell in row.strip("| ").split(" | ")[1:3])
        assert ref > 0 and native > 0
