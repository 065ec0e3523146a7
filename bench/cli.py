"""`shardserve bench`: a load generator for any OpenAI-compatible server, and `bench report` to merge results.

    shardserve bench --base-url http://127.0.0.1:8000 --prompt-tokens 512 --output-tokens 128 \\
        --num-prompts 200 --concurrency 10,50,100 --label shardserve --csv runs.csv --plot runs.png
    shardserve bench report shardserve.csv vllm.csv --plot side_by_side.png --baseline vllm

`vllm bench serve`'s names work too where they mean the same (--max-concurrency, --random-input-len,
--random-output-len, --random-prefix-len, --num-warmups, --disable-tqdm, --host and --port, --backend,
--endpoint /v1/completions, --dataset-name random), so its command lines run with the binary's name changed:

    shardserve bench --backend openai-chat --endpoint /v1/chat/completions --dataset-name random \\
        --random-input-len 512 --random-output-len 128 --num-prompts 200 --max-concurrency 10

`--dataset-name grounded` asks the model to repeat or lightly edit a passage of Python source instead (the load
of speculative decoding); `--save-dataset X.jsonl` writes those prompts for vLLM's client, which then sends the
same ones with `--dataset-name custom --dataset-path X.jsonl --custom-output-len N --disable-shuffle`. A server
that speculates shows its acceptance in /metrics, and each run prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from bench.flags import flag_help
from bench.report import format_ratios, format_table, plot, read_csvs
from bench.run import BenchArgs, run_bench

# --endpoint's values as vLLM spells them (its paths), and --backend's request formats
ENDPOINT_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
BACKEND_ENDPOINTS = {"vllm": "completions", "openai": "completions", "openai-chat": "chat"}


def _endpoint(text: str) -> str:
    return ENDPOINT_PATHS.get(text, text)


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def json_object(text: str) -> dict:
    """An argparse type: a JSON object (`--extra-body`), else a usage error naming the text."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


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

    # a second name is `vllm bench serve`'s for the same setting
    flag("--base-url", field="base_url")  # None: from --host and --port, else BenchArgs' default
    parser.add_argument("--host", help="the server's host when --base-url is not given (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, help="the server's port when --base-url is not given (default: 8000)")
    flag("--model", field="model")
    flag("--endpoint", field="endpoint", type=_endpoint, choices=["completions", "chat"])
    parser.add_argument("--backend", choices=list(BACKEND_ENDPOINTS), help=(
        "vLLM's request format: openai-chat is --endpoint chat, vllm and openai are completions"))
    flag("--dataset-name", field="dataset_name", choices=["random", "grounded"], default=defaults.dataset_name)
    flag("--save-dataset", field="save_dataset", metavar="PATH")
    flag("--api-key", field="api_key")
    flag("--tokenizer", field="tokenizer")
    flag("--prompt-tokens", "--random-input-len", field="prompt_tokens", type=int, default=defaults.prompt_tokens)
    flag("--output-tokens", "--random-output-len", field="output_tokens", type=int, default=defaults.output_tokens)
    flag("--shared-prefix-tokens", "--random-prefix-len", field="shared_prefix_tokens", type=int,
         default=defaults.shared_prefix_tokens)
    flag("--num-shared-prefixes", field="num_shared_prefixes", type=int, default=defaults.num_shared_prefixes)
    flag("--num-prompts", field="num_prompts", type=_int_list, default=defaults.num_prompts)
    flag("--concurrency", "--max-concurrency", field="concurrency", type=_int_list, default=defaults.concurrency)
    flag("--request-rate", field="request_rate", type=float)
    flag("--warmup", "--num-warmups", field="warmup", type=int, default=defaults.warmup)
    flag("--seed", field="seed", type=int, default=defaults.seed)
    flag("--temperature", field="temperature", type=float)
    flag("--ignore-eos", field="ignore_eos", action=argparse.BooleanOptionalAction, default=defaults.ignore_eos)
    flag("--extra-body", field="extra_body", type=json_object, metavar="JSON")
    flag("--timeout", field="timeout_s", type=float, default=defaults.timeout_s)
    flag("--label", field="label", default=defaults.label)
    flag("--csv", field="csv")
    flag("--json", field="json_path")
    flag("--plot", field="plot")
    parser.add_argument("--no-progress", "--disable-tqdm", dest="progress", action="store_false",
                        help="no progress bars")
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
    result = asyncio.run(run_bench(bench_args_from(args)))
    print(format_table(result.summaries))
    return 0 if all(s.successes for s in result.summaries) else 1


def bench_args_from(args: argparse.Namespace) -> BenchArgs:
    """The settings of a `bench` command line, vLLM's spellings (--host/--port, --backend) resolved."""
    settings = {k: v for k, v in vars(args).items() if k in BenchArgs.model_fields}
    if settings["base_url"] is None:
        del settings["base_url"]
        if args.host is not None or args.port is not None:
            settings["base_url"] = f"http://{args.host or '127.0.0.1'}:{args.port or 8000}"
    if args.backend is not None:
        if settings["endpoint"] not in (None, BACKEND_ENDPOINTS[args.backend]):
            raise SystemExit(f"shardserve bench: --backend {args.backend} sends to "
                             f"{BACKEND_ENDPOINTS[args.backend]}, not --endpoint {settings['endpoint']}")
        settings["endpoint"] = BACKEND_ENDPOINTS[args.backend]
    if settings["endpoint"] is None:
        del settings["endpoint"]
    return BenchArgs(**settings)


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

