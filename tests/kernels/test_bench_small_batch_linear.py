"""scripts/bench_small_batch_linear.py times every product at every row count and says which the engine runs (no
timing is asserted)."""

import torch

from kernels import cpu_native
from kernels.linear import small_batch_kernels
from scripts.bench_small_batch_linear import ROWS, VECTOR_MAX_ROWS, main


def onednn_packs_bfloat16() -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


def test_every_row_count_is_timed_and_the_engines_choice_named(capsys):
    main(["--repeats", "1", "--models", "bench model"])
    rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    packable = ["bfloat16"] if onednn_packs_bfloat16() else []
    assert [(dtype, int(count)) for dtype, _, count, *_ in rows] == [
        (dtype, count) for dtype in (*packable, "float32") for count in ROWS]
    native = cpu_native.load()
    kernels = small_batch_kernels(native)
    for dtype, model, count, onednn_ms, vector_ms, amx_ms, ratio, used in rows:
        assert model == "bench model" and float(onednn_ms) > 0 and float(ratio) > 0
        assert (vector_ms != "-") == (int(count) <= VECTOR_MAX_ROWS)
        amx = dtype == "bfloat16" and native.amx_linear_available()
        assert (amx_ms != "-") == amx
        kernel = kernels[getattr(torch, dtype)]
        assert used == ("oneDNN" if int(count) > kernel.max_rows else "AMX" if amx else "vector")
