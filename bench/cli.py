"""`shardserve bench`: a load generator for any OpenAI-compatible server, and `bench report` to merge results.

    shardserve bench --base-url http://127.0.0.1:8000 --prompt-tokens 512 --output-tokens 128 \\
        --num-prompts 200 --concurrency 10,50,100 --label shardserve --csv runs.csv --plot runs.png
    shardserve bench report shardserve.csv vllm.csv --plot side_by_side.png --baseline vllm
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from bench.flags import flag_help
from bench.report import format_ratios, format_table, plot, read_csvs
from bench.run import BenchArgs, run_bench


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` (and `bench report`) on an argparse subparsers object; dispatch with args.func(args)."""
    parser = subparsers.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server (or `bench report` to merge CSVs)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = BenchArgs()

    def flag(*names: str, field: str, **kwargs) -> None:
        parser.add_argument(*names, dest=field, help=flag_help(BenchArgs.model_fields[field]), **kwargs)

    flag("--base-url", field="base_url", default=defaults.base_url)
    flag("--model", field="model")
    flag("--endpoint", field="endpoint", choices=["completions", "chat"], default=defaults.endpoint)
    flag("--api-key", field="api_key")
    flag("--tokenizer", field="tokenizer")
    flag("--prompt-tokens", field="prompt_tokens", type=int, default=defaults.prompt_tokens)
    flag("--output-tokens", field="output_tokens", type=int, default=defaults.output_tokens)
    flag("--shared-prefix-tokens", field="shared_prefix_tokens", type=int, default=defaults.shared_prefix_tokens)
    flag("--num-shared-prefixes", field="num_shared_prefixes", type=int, default=defaults.num_shared_prefixes)
    flag("--num-prompts", field="num_prompts", type=_int_list, default=defaults.num_prompts)
    flag("--concurrency", field="concurrency", type=_int_list, default=defaults.concurrency)
    flag("--request-rate", field="request_rate", type=float)
    flag("--warmup", field="warmup", type=int, default=defaults.warmup)
    flag("--seed", field="seed", type=int, default=defaults.seed)
    flag("--temperature", field="temperature", type=float)
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="let EOS end a request before its output tokens (default: every request generates "
                             "all of them)")
    flag("--timeout", field="timeout_s", type=float, default=defaults.timeout_s)
    flag("--label", field="label", default=defaults.label)
    flag("--csv", field="csv")
    flag("--json", field="json_path")
    flag("--plot", field="plot")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    parser.set_defaults(func=_bench_command, bench_command=None)

    nested = parser.add_subparsers(dest="bench_command", metavar="report")
    report = nested.add_parser("report", help="merge bench CSVs into one table and plot")
    report.add_argument("csvs", nargs="+", metavar="CSV", help="CSV files that `shardserve bench --csv` wrote")
    report.add_argument("--plot", help="PNG: throughput and TTFT p95 against concurrency, one line per label")
    report.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    report.add_argument("--baseline", help="label to print the others' ratios against")
    report.add_argument("--title", help="plot title")
    return parser


def _bench_command(args: argparse.Namespace) -> int:
    if args.bench_command == "report":
        return report_command(
            args.csvs, plot_path=args.plot, markdown=args.markdown, baseline=args.baseline, title=args.title
        )
    names = set(BenchArgs.model_fields)
    bench_args = BenchArgs(**{k: v for k, v in vars(args).items() if k in names})
    result = asyncio.run(run_bench(bench_args))
    print(format_table(result.summaries))
    return 0 if all(s.successes for s in result.summaries) else 1


def report_command(
    csv_paths: list[str],
    plot_path: str | None = None,
    markdown: bool = False,
    baseline: str | None = None,
    title: str | None = None,
) -> int:
    """Print one table for runs from several CSVs (and their ratios to a baseline); plot them together."""
    summaries = read_csvs(csv_paths)
    print(format_table(summaries, markdown=markdown))
    if baseline:
        print(format_ratios(summaries, baseline))
    if plot_path:
        plot(plot_path, summaries, title=title)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)

