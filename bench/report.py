"""Benchmark results: one summary per run, the classic comparison table, CSV/JSON files, plots, and merging."""

from __future__ import annotations

import csv
import json
import math
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import MISSING, asdict, dataclass, fields

import matplotlib
import numpy as np

from bench.client import RequestResult


@dataclass
class RunSummary:
    """One load run (one concurrency or request rate): its settings and its measurements.

    Times: TTFT / TPOT / ITL in milliseconds, latency and wall time in seconds, throughput in tokens/s.
    """

    # settings
    timestamp: str
    label: str
    base_url: str
    model: str
    endpoint: str
    concurrency: int | None
    request_rate: float | None
    num_prompts: int
    prompt_tokens: int
    output_tokens: int
    shared_prefix_tokens: int
    num_shared_prefixes: int
    seed: int
    # measurements
    successes: int
    failures: int
    wall_s: float
    generated_tokens: int
    total_prompt_tokens: int
    output_throughput: float
    total_throughput: float
    request_throughput: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    ttft_p99_ms: float
    tpot_mean_ms: float
    tpot_p95_ms: float
    itl_p95_ms: float
    latency_mean_s: float
    latency_p95_s: float
    usage_mismatches: int
    prefix_cache_hit_rate: float  # cached prompt tokens / prompt tokens, as the server's usage says (nan: not said)
    errors: str  # "count x message" entries joined by " | "
    # last, with defaults, so CSVs written before them still read back
    dataset_name: str = "random"  # a setting: the prompts' source (bench/grounded.py for grounded)
    spec_acceptance_rate: float = math.nan  # accepted / proposed tokens in the server's /metrics (nan: not shown)
    spec_acceptance_length: float = math.nan  # tokens per verifying step, accepted proposals + 1 (nan: not shown)

    @classmethod
    def from_records(cls, records: Sequence[RequestResult], wall_s: float, settings: dict) -> RunSummary:
        """Aggregate a run's request records; failed requests count as failures and add no tokens."""
        ok = [r for r in records if r.ok]
        ttfts_ms = [1000 * r.ttft_s for r in ok if r.ttft_s is not None]
        # TPOT: time per output token after the first, per request that produced more than one
        tpots_ms = [
            1000 * (r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1
        ]
        itls_ms = [1000 * gap for r in ok for gap in r.inter_token_latencies_s]
        latencies_s = [r.latency_s for r in ok]
        generated = sum(r.output_tokens for r in ok)
        prompt_total = sum(r.prompt_tokens or r.expected_prompt_tokens or 0 for r in ok)
        reporting = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
        hit_rate = (sum(r.cached_tokens for r in reporting) / sum(r.prompt_tokens for r in reporting)
                    if reporting else math.nan)
        return cls(
            **settings,
            successes=len(ok),
            failures=len(records) - len(ok),
            wall_s=wall_s,
            generated_tokens=generated,
            total_prompt_tokens=prompt_total,
            output_throughput=generated / wall_s if wall_s > 0 else 0.0,
            total_throughput=(generated + prompt_total) / wall_s if wall_s > 0 else 0.0,
            request_throughput=len(ok) / wall_s if wall_s > 0 else 0.0,
            ttft_mean_ms=_mean(ttfts_ms),
            ttft_p50_ms=_percentile(ttfts_ms, 50),
            ttft_p95_ms=_percentile(ttfts_ms, 95),
            ttft_p99_ms=_percentile(ttfts_ms, 99),
            tpot_mean_ms=_mean(tpots_ms),
            tpot_p95_ms=_percentile(tpots_ms, 95),
            itl_p95_ms=_percentile(itls_ms, 95),
            latency_mean_s=_mean(latencies_s),
            latency_p95_s=_percentile(latencies_s, 95),
            usage_mismatches=sum(1 for r in ok if r.usage_mismatch),
            prefix_cache_hit_rate=hit_rate,
            errors=summarize_errors(records),
        )

    @classmethod
    def from_csv_row(cls, row: dict[str, str]) -> RunSummary:
        """A summary read back from a CSV row (the inverse of to_csv_row)."""
        values = {}
        for f in fields(cls):
            if f.name not in row and f.default is not MISSING:
                continue  # a column newer than the file
            raw = row.get(f.name, "")
            if f.type in ("str",):
                values[f.name] = raw
            elif raw == "" and "None" in f.type:
                values[f.name] = None
            elif f.type.startswith("int"):
                values[f.name] = int(float(raw or 0))
            else:
                value = float(raw or "nan")
                values[f.name] = math.nan if math.isnan(value) else value  # math.nan itself: equal summaries compare equal
        return cls(**values)

    def to_csv_row(self) -> dict[str, object]:
        return {k: "" if v is None else v for k, v in asdict(self).items()}

    @property
    def load(self) -> str:
        """The run's load as the table shows it: the concurrency, or the request rate."""
        if self.request_rate:
            cap = f" (max {self.concurrency})" if self.concurrency else ""
            return f"{self.request_rate:g} req/s{cap}"
        return str(self.concurrency)


CSV_FIELDS = [f.name for f in fields(RunSummary)]


def summarize_errors(records: Iterable[RequestResult], usage_too: bool = True) -> str:
    """Failures and usage mismatches, grouped by message, most frequent first: "3 x HTTP 503: busy | ..."."""
    messages = Counter(r.error for r in records if r.error)
    if usage_too:
        messages.update(f"usage: {m}" for r in records if (m := r.usage_mismatch))
    return " | ".join(f"{n} x {message}" for message, n in messages.most_common())


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


# ---- the classic comparison table -------------------------------------------------------------------

TABLE_COLUMNS = [
    ("Framework", lambda s: s.label),
    ("Concurrency", lambda s: s.load),
    ("Success", lambda s: f"{s.successes}/{s.successes + s.failures}"),
    ("Total time (s)", lambda s: f"{s.wall_s:.2f}"),
    ("Generated tokens", lambda s: str(s.generated_tokens)),
    ("Throughput (tok/s)", lambda s: f"{s.output_throughput:.1f}"),
    ("TTFT mean (ms)", lambda s: f"{s.ttft_mean_ms:.1f}"),
    ("TTFT p95 (ms)", lambda s: f"{s.ttft_p95_ms:.1f}"),
    ("TPOT mean (ms)", lambda s: f"{s.tpot_mean_ms:.1f}"),
    ("Latency mean (s)", lambda s: f"{s.latency_mean_s:.2f}"),
]


def format_table(summaries: Sequence[RunSummary], markdown: bool = False) -> str:
    """The framework-by-framework table (plain text aligned columns, or Markdown)."""
    header = [name for name, _ in TABLE_COLUMNS]
    rows = [[cell(s) for _, cell in TABLE_COLUMNS] for s in summaries]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join(
        [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]
    )


def format_details(summary: RunSummary) -> str:
    """The full measurements of one run, for the console after it finishes."""
    s = summary
    lines = [
        f"[{s.label}] load {s.load}: {s.successes}/{s.successes + s.failures} succeeded in {s.wall_s:.2f} s",
        f"  generated {s.generated_tokens} tokens: {s.output_throughput:.1f} tok/s output, "
        f"{s.total_throughput:.1f} tok/s total, {s.request_throughput:.2f} req/s",
        f"  TTFT ms mean {s.ttft_mean_ms:.1f}  p50 {s.ttft_p50_ms:.1f}  p95 {s.ttft_p95_ms:.1f}  p99 {s.ttft_p99_ms:.1f}",
        f"  TPOT ms mean {s.tpot_mean_ms:.2f}  p95 {s.tpot_p95_ms:.2f}   ITL p95 {s.itl_p95_ms:.2f} ms",
        f"  latency s mean {s.latency_mean_s:.3f}  p95 {s.latency_p95_s:.3f}",
    ]
    if not math.isnan(s.prefix_cache_hit_rate):
        lines.append(f"  prefix cache: {100 * s.prefix_cache_hit_rate:.1f}% of prompt tokens were cached")
    if not math.isnan(s.spec_acceptance_rate):
        lines.append(f"  speculative decoding: acceptance rate {100 * s.spec_acceptance_rate:.1f}%, "
                     f"acceptance length {s.spec_acceptance_length:.2f} (the server's /metrics over this run)")
    if s.usage_mismatches:
        lines.append(f"  usage mismatches: {s.usage_mismatches} requests")
    if s.errors:
        lines.append(f"  errors: {s.errors}")
    return "\n".join(lines)


def format_ratios(summaries: Sequence[RunSummary], baseline: str) -> str:
    """Each label's throughput and TTFT p95 as multiples of the baseline label's, load by load."""
    by_load = _mean_by(summaries)
    lines = []
    for (label, load), s in sorted(by_load.items(), key=lambda kv: (kv[0][0], _sort_key(kv[1]))):
        base = by_load.get((baseline, load))
        if label == baseline or base is None:
            continue
        lines.append(
            f"{label} vs {baseline} at {load}: throughput x{s.output_throughput / base.output_throughput:.2f}, "
            f"TTFT p95 x{s.ttft_p95_ms / base.ttft_p95_ms:.2f}"
        )
    return "\n".join(lines)


# ---- files --------------------------------------------------------------------------------------------


def append_csv(path: str, summaries: Sequence[RunSummary]) -> None:
    """Append one row per run; a new or empty file gets the header first."""
    exists = os.path.exists(path) and os.path.getsize(path) > 0
    if exists:
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if header != CSV_FIELDS:
            raise ValueError(f"{path} has other columns than this version writes; use a new --csv file")
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        if not exists:
            writer.writeheader()
        writer.writerows(s.to_csv_row() for s in summaries)


def read_csvs(paths: Sequence[str]) -> list[RunSummary]:
    """Every run from several CSV files, in file order."""
    summaries = []
    for path in paths:
        with open(path, newline="") as f:
            summaries.extend(RunSummary.from_csv_row(row) for row in csv.DictReader(f))
    return summaries


def write_json(
    path: str, summaries: Sequence[RunSummary], records: Sequence[Sequence[RequestResult]]
) -> None:
    """Summaries plus each request's timings (ttft, latency, tokens, error), one entry per run."""
    runs = []
    for summary, run_records in zip(summaries, records, strict=True):
        requests = [
            {
                "ttft_s": r.ttft_s,
                "latency_s": r.latency_s,
                "output_tokens": r.output_tokens,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "itl_s": r.inter_token_latencies_s,
                "error": r.error,
            }
            for r in run_records
        ]
        runs.append({"summary": _json_safe(asdict(summary)), "requests": requests})
    with open(path, "w") as f:
        json.dump({"runs": runs}, f, indent=1)


def _json_safe(d: dict) -> dict:
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in d.items()}


# ---- plots --------------------------------------------------------------------------------------------


def plot(path: str, summaries: Sequence[RunSummary], title: str | None = None) -> None:
    """Output throughput and TTFT p95 against concurrency (or request rate), one line per label."""
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # here, not at the top: it is slow to import

    by_load = _mean_by(summaries)
    rate_mode = all(s.request_rate for s in summaries)
    x_of = (lambda s: s.request_rate) if rate_mode else (lambda s: s.concurrency)
    labels = list(dict.fromkeys(s.label for s in summaries))
    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in labels:
        points = sorted((x_of(s), s) for (lab, _), s in by_load.items() if lab == label and x_of(s))
        xs = [x for x, _ in points]
        ax_tp.plot(xs, [s.output_throughput for _, s in points], marker="o", label=label)
        ax_ttft.plot(xs, [s.ttft_p95_ms for _, s in points], marker="o", label=label)
    xlabel = "request rate (req/s)" if rate_mode else "concurrency"
    ax_tp.set(xlabel=xlabel, ylabel="output throughput (tok/s)", title="Throughput (higher is better)")
    ax_ttft.set(xlabel=xlabel, ylabel="TTFT p95 (ms)", title="TTFT p95 (lower is better)")
    xs = sorted({x_of(s) for s in by_load.values() if x_of(s)})
    for ax in (ax_tp, ax_ttft):
        if len(xs) > 1 and xs[-1] / xs[0] >= 8:
            ax.set_xscale("log")  # 1, 10, 50, 100 spread evenly
        if xs:
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
            ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _sort_key(s: RunSummary) -> tuple:
    return (s.request_rate or 0.0, s.concurrency or 0)


def _mean_by(summaries: Sequence[RunSummary]) -> dict[tuple[str, str], RunSummary]:
    """One summary per (label, load): repeated runs averaged field by field (settings from the last)."""
    groups: dict[tuple[str, str], list[RunSummary]] = defaultdict(list)
    for s in summaries:
        groups[(s.label, s.load)].append(s)
    merged = {}
    for key, group in groups.items():
        values = asdict(group[-1])
        for name in (
            "output_throughput",
            "total_throughput",
            "ttft_mean_ms",
            "ttft_p95_ms",
            "latency_mean_s",
        ):
            values[name] = float(np.mean([getattr(s, name) for s in group]))
        merged[key] = RunSummary(**values)
    return merged
