"""Run summaries, tables and CSV merging of `shardserve bench`, from hand-made request records."""

from __future__ import annotations

import math

import pytest

from bench.client import RequestResult, error_message, normalize_base_url
from bench.report import (
    RunSummary,
    append_csv,
    format_details,
    format_ratios,
    format_table,
    read_csvs,
    summarize_errors,
)
from bench.server_metrics import SpecDecodeCounters, acceptance_between, parse_spec_decode_counters

SETTINGS = dict(
    timestamp="2026-11-29T08:00:00+00:00",
    label="shardserve",
    base_url="http://127.0.0.1:8000",
    model="m",
    endpoint="completions",
    concurrency=2,
    request_rate=None,
    num_prompts=3,
    prompt_tokens=10,
    output_tokens=3,
    shared_prefix_tokens=0,
    num_shared_prefixes=0,
    seed=0,
)


def _record(index, start, chunks, prompt_tokens=10, completion_tokens=3, error=None):
    """A request sent at `start` whose content chunks arrived at the absolute times `chunks`."""
    record = RequestResult(
        index=index,
        scheduled_s=start,
        start_s=start,
        error=error,
        expected_prompt_tokens=10,
        expected_completion_tokens=3,
    )
    if error is None:
        record.chunk_times_s = [t - start for t in chunks]
        record.ttft_s = record.chunk_times_s[0]
        record.end_s = chunks[-1] + 0.01
        record.prompt_tokens, record.completion_tokens = prompt_tokens, completion_tokens
    else:
        record.end_s = start + 0.05
    return record


def test_summary_metrics_follow_their_definitions():
    records = [
        _record(0, 0.0, [0.1, 0.2, 0.3]),  # ttft 0.1, latency 0.31, tpot (0.31-0.1)/2
        _record(1, 0.0, [0.3, 0.4, 0.7]),  # ttft 0.3, latency 0.71, tpot (0.71-0.3)/2
        _record(2, 0.5, [], error="HTTP 503: busy"),
    ]
    s = RunSummary.from_records(records, wall_s=0.71, settings=SETTINGS)
    assert (s.successes, s.failures, s.generated_tokens, s.total_prompt_tokens) == (2, 1, 6, 20)
    assert s.output_throughput == pytest.approx(6 / 0.71)
    assert s.total_throughput == pytest.approx(26 / 0.71)
    assert s.ttft_mean_ms == pytest.approx(200.0)
    assert s.ttft_p50_ms == pytest.approx(200.0)
    assert s.ttft_p95_ms == pytest.approx(100 + 0.95 * 200)  # linear interpolation between 100 and 300
    assert s.tpot_mean_ms == pytest.approx(1000 * ((0.21 / 2) + (0.41 / 2)) / 2)
    assert s.itl_p95_ms == pytest.approx(100 + 0.85 * 200)  # gaps 100 100 100 300 ms: 2.85 of the way
    assert s.latency_mean_s == pytest.approx((0.31 + 0.71) / 2)
    assert s.errors == "1 x HTTP 503: busy"
    assert s.usage_mismatches == 0


def test_usage_mismatches_are_counted_and_named():
    records = [_record(0, 0.0, [0.1, 0.2], completion_tokens=2), _record(1, 0.0, [0.1, 0.2, 0.3])]
    s = RunSummary.from_records(records, wall_s=1.0, settings=SETTINGS)
    assert s.usage_mismatches == 1
    assert s.errors == "1 x usage: completion_tokens 2 != 3"
    no_usage = _record(2, 0.0, [0.1])
    no_usage.prompt_tokens = no_usage.completion_tokens = None
    assert no_usage.usage_mismatch == "no usage in the stream"
    assert no_usage.output_tokens == 1  # counted from the chunks when the server gives no usage


def test_a_run_where_everything_failed_has_no_latency_figures():
    records = [_record(i, 0.0, [], error="HTTP 401: bad key") for i in range(4)]
    s = RunSummary.from_records(records, wall_s=0.05, settings=SETTINGS)
    assert (s.successes, s.failures, s.generated_tokens, s.output_throughput) == (0, 4, 0, 0.0)
    assert math.isnan(s.ttft_mean_ms) and math.isnan(s.latency_p95_s)
    assert summarize_errors(records) == "4 x HTTP 401: bad key"


def test_csv_rows_read_back_as_the_same_summaries(tmp_path):
    path = str(tmp_path / "runs.csv")
    reported = _record(0, 0.0, [0.1, 0.2, 0.3])
    reported.cached_tokens = 4
    first = RunSummary.from_records([reported], 0.31, SETTINGS)
    rated = RunSummary.from_records(
        [reported],
        0.31,
        {**SETTINGS, "request_rate": 4.0, "concurrency": None, "label": "vllm"},
    )
    append_csv(path, [first])
    append_csv(path, [rated])
    assert read_csvs([path]) == [first, rated]


def test_the_prefix_cache_hit_rate_is_cached_over_prompt_tokens_where_the_server_says():
    records = [_record(0, 0.0, [0.1, 0.2]), _record(1, 0.0, [0.1, 0.2]), _record(2, 0.0, [0.1, 0.2])]
    assert math.isnan(RunSummary.from_records(records, 1.0, SETTINGS).prefix_cache_hit_rate)
    records[0].cached_tokens, records[1].cached_tokens = 8, 0  # the third request's usage said nothing
    summary = RunSummary.from_records(records, 1.0, SETTINGS)
    assert summary.prefix_cache_hit_rate == pytest.approx(8 / 20)
    assert "40.0% of prompt tokens were cached" in format_details(summary)


def test_appending_to_a_csv_with_other_columns_is_refused(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("a,b\n1,2\n")
    summary = RunSummary.from_records([_record(0, 0.0, [0.1])], 0.2, SETTINGS)
    with pytest.raises(ValueError, match="other columns"):
        append_csv(str(path), [summary])


def test_table_has_the_classic_comparison_columns_and_ratios_compare_labels_at_equal_load():
    ours = RunSummary.from_records([_record(0, 0.0, [0.1, 0.2, 0.3])], 0.5, SETTINGS)
    theirs = RunSummary.from_records([_record(0, 0.0, [0.2, 0.4, 0.6])], 1.0, {**SETTINGS, "label": "vllm"})
    table = format_table([ours, theirs], markdown=True).splitlines()
    assert table[0] == (
        "| Framework | Concurrency | Success | Total time (s) | Generated tokens | Throughput (tok/s) | "
        "TTFT mean (ms) | TTFT p95 (ms) | TPOT mean (ms) | Latency mean (s) |"
    )
    assert table[2].startswith("| shardserve | 2 | 1/1 | 0.50 | 3 | 6.0 | 100.0 |")
    assert format_ratios([ours, theirs], baseline="vllm") == (
        "shardserve vs vllm at 2: throughput x2.00, TTFT p95 x0.50"
    )


@pytest.mark.parametrize(
    "given",
    [
        "http://127.0.0.1:8000",
        "http://127.0.0.1:8000/",
        "http://127.0.0.1:8000/v1",
        "http://127.0.0.1:8000/v1/",
    ],
)
def test_base_url_may_name_the_server_or_its_v1_root(given):
    assert normalize_base_url(given) == "http://127.0.0.1:8000/v1"


def test_error_messages_are_taken_from_openai_shaped_bodies():
    assert error_message('{"error": {"message": "bad key", "code": 401}}') == "bad key"
    assert error_message('{"detail": "Not Found"}') == "Not Found"
    assert error_message("upstream timed out") == "upstream timed out"


def test_make_bench_rewrites_only_its_own_block_of_the_benchmarks_doc(tmp_path):
    from scripts.bench_serve import DOC_BEGIN, DOC_END, rewrite_doc_section

    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(
        f"# Benchmarks\n\n## Engine\n\nengine table\n\n## Serving benchmark\n\nhow\n\n{DOC_BEGIN}\nold\n{DOC_END}\n\n## Other\n\nkept\n"
    )
    rewrite_doc_section(doc, "new table")
    rewrite_doc_section(doc, "newer table")
    assert doc.read_text() == (
        f"# Benchmarks\n\n## Engine\n\nengine table\n\n## Serving benchmark\n\nhow\n\n{DOC_BEGIN}\nnewer table\n{DOC_END}\n\n## Other\n\nkept\n"
    )

    fresh = tmp_path / "NEW.md"
    rewrite_doc_section(fresh, "table")
    rewrite_doc_section(fresh, "table 2")
    assert fresh.read_text() == f"# Benchmarks\n\n## Serving benchmark\n\n{DOC_BEGIN}\ntable 2\n{DOC_END}\n"


def test_a_csv_from_before_the_dataset_and_acceptance_columns_reads_back_with_their_defaults(tmp_path):
    path = tmp_path / "old.csv"
    summary = RunSummary.from_records([_record(0, 0.0, [0.1, 0.2, 0.3])], 0.31, SETTINGS)
    append_csv(str(path), [summary])
    newer = ("dataset_name", "spec_acceptance_rate", "spec_acceptance_length")
    rows = [line.split(",") for line in path.read_text().splitlines()]
    keep = [i for i, name in enumerate(rows[0]) if name not in newer]
    path.write_text("".join(",".join(row[i] for i in keep) + "\n" for row in rows))
    (read,) = read_csvs([str(path)])
    assert read.dataset_name == "random"
    assert math.isnan(read.spec_acceptance_rate) and math.isnan(read.spec_acceptance_length)
    assert read.output_throughput == summary.output_throughput


def test_the_acceptance_line_is_printed_only_for_a_run_that_saw_speculation():
    summary = RunSummary.from_records([_record(0, 0.0, [0.1, 0.2, 0.3])], 0.31, SETTINGS)
    assert "speculative" not in format_details(summary)
    summary.spec_acceptance_rate, summary.spec_acceptance_length = 0.625, 3.5
    assert "speculative decoding: acceptance rate 62.5%, acceptance length 3.50" in format_details(summary)


# ---- speculative decoding's counters in /metrics ---------------------------------------------------------

SHARDSERVE_METRICS = """\
# HELP shardserve:num_requests_running Requests in the running batch.
# TYPE shardserve:num_requests_running gauge
shardserve:num_requests_running{model_name="m",replica="r 1"} 2.0
# HELP shardserve:spec_decode_num_drafts_total Sequence-steps that verified proposed tokens.
# TYPE shardserve:spec_decode_num_drafts_total counter
shardserve:spec_decode_num_drafts_total{model_name="m",replica="r 1"} 10.0
shardserve:spec_decode_num_drafts_total{model_name="m",replica="r}2"} 6.0
# TYPE shardserve:spec_decode_num_draft_tokens_total counter
shardserve:spec_decode_num_draft_tokens_total{model_name="m",replica="r 1"} 40.0
shardserve:spec_decode_num_draft_tokens_total{model_name="m",replica="r}2"} 24.0
# TYPE shardserve:spec_decode_num_accepted_tokens_total counter
shardserve:spec_decode_num_accepted_tokens_total{model_name="m",replica="r 1"} 20.0
shardserve:spec_decode_num_accepted_tokens_total{model_name="m",replica="r}2"} 12.0
shardserve:spec_decode_num_emitted_tokens_total{model_name="m",replica="r 1"} 30.0
shardserve:spec_decode_acceptance_length_bucket{le="0",model_name="m",replica="r 1"} 3.0
"""


def test_spec_decode_counters_are_read_from_any_namespace_and_summed_over_labels():
    counters = parse_spec_decode_counters(SHARDSERVE_METRICS)
    assert counters == SpecDecodeCounters(num_drafts=16, num_draft_tokens=64, num_accepted_tokens=32)
    vllm = "vllm:spec_decode_num_draft_tokens_total{engine=\"0\"} 7 1700000000\n" \
           "vllm:spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"} 5\n"
    assert parse_spec_decode_counters(vllm) == SpecDecodeCounters(num_draft_tokens=7)  # per position: not a total
    assert parse_spec_decode_counters(SHARDSERVE_METRICS.split("# HELP shardserve:spec")[0]) is None


def test_a_runs_acceptance_is_the_difference_of_two_scrapes():
    before = SpecDecodeCounters(num_drafts=100, num_draft_tokens=400, num_accepted_tokens=0)
    after = SpecDecodeCounters(num_drafts=110, num_draft_tokens=440, num_accepted_tokens=30)
    accepted = acceptance_between(before, after)
    assert (accepted.rate, accepted.length) == (0.75, 4.0)
    assert acceptance_between(before, before) is None  # nothing proposed during the run
    assert acceptance_between(None, after) is None and acceptance_between(before, None) is None
