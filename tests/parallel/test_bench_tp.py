"""scripts/bench_tp.py: the all-reduce volume it reports and the one docs block it rewrites."""

from __future__ import annotations

from scripts.bench_tp import BEGIN, END, allreduced_bytes, overhead_lines, table, write_docs


def test_allreduced_bytes_count_o_proj_and_down_proj_of_every_layer():
    # bench model: 8 layers, hidden 512, float32; a decode step of 8 tokens
    assert allreduced_bytes(num_layers=8, num_tokens=8, hidden=512) == 2 * 8 * 8 * 512 * 4 == 262_144


def test_docs_rewrite_replaces_only_the_tp_block(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    before, after = "## Serving\nkept\n\n## Tensor parallelism\nintro\n", "\nouter text\n"
    doc.write_text(f"{before}{BEGIN}\nold table\n{END}{after}")
    write_docs("new table", doc)
    assert doc.read_text() == f"{before}{BEGIN}\nnew table\n{END}{after}"


def test_table_shows_each_size_against_tp1():
    rows = [
        dict(tp=1, decode_ms=10.0, prefill_ms=100.0, decode_bytes=1024, prefill_bytes=4096),
        dict(tp=2, decode_ms=15.0, prefill_ms=120.0, decode_bytes=1024, prefill_bytes=4096),
    ]
    lines = table(rows, decode_batch=8, prefill_tokens=128).splitlines()
    assert lines[2] == "| 1 | 10.0 ms | 1.00x | 0 | 100.0 ms | 1.00x | 0 |"
    assert lines[3] == "| 2 | 15.0 ms | 1.50x | 1 KiB | 120.0 ms | 1.20x | 4 KiB |"


def test_overhead_is_step_time_above_an_even_split_of_tp1_per_collective():
    rows = [
        dict(tp=1, decode_ms=40.0, prefill_ms=100.0, layers=8),
        dict(tp=2, decode_ms=60.0, prefill_ms=110.0, layers=8),
    ]
    # 20 collectives: 2 broadcast messages + 16 row-parallel all-reduces + embedding + logits gather
    assert overhead_lines(rows) == [
        "- TP=2: time over TP=1 / 2: decode 40.0 ms (2.00 ms per collective), "
        "prefill 60.0 ms (3.00 ms per collective), 20 collectives a step"
    ]
