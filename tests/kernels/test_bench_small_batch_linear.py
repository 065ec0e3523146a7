"""scripts/bench_small_batch_linear.py times both products at every row count and says which the engine runs
(no timing is asserted)."""

import torch

from kernels.linear import SMALL_BATCH_MAX_ROWS
from scripts.bench_small_batch_linear import ROWS, main


def onednn_packs_bfloat16() -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


def test_every_row_count_is_timed_both_ways_and_the_engines_choice_named(capsys):
    main(["--repeats", "1", "--models", "bench model"])
    rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    packable = ["bfloat16"] if onednn_packs_bfloat16() else []
    assert [(dtype, int(count)) for dtype, _, count, *_ in rows] == [
        (dtype, count) for dtype in (*packable, "float32") for count in ROWS]
    for dtype, model, count, onednn_ms, native_ms, ratio, used in rows:
        assert model == "bench model" and float(onednn_ms) > 0 and float(native_ms) > 0 and float(ratio) > 0
        limit = SMALL_BATCH_MAX_ROWS[getattr(torch, dtype)]
        assert used == ("native" if int(count) <= limit else "oneDNN")
