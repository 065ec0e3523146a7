"""`shardserve bench`: a load generator for any OpenAI-compatible server, and `bench report` to merge results.

    shardserve bench --base-url http://127.0.0.1:8000 --prompt-tokens 512 --output-tokens 128 \\
        --num-prompts 200 --concurrency 10,50,100 --label shardserve --csv runs.csv --plot runs.png
    shardserve bench report shardserve.csv vllm.csv --plot side_by_side.png --baseline vllm
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.bench_client import OpenAIStreamClient, RequestRecord, RequestSpec, first_model_id, run_load
from app.bench_prompts import PromptBuilder, load_tokenizer
from app.bench_report import (
    RunSummary,
    append_csv,
    format_details,
    format_ratios,
    format_table,
    plot,
    read_csvs,
    write_json,
)
from app.cli import flag_help


class BenchArgs(BaseModel):
    """Settings of one `shardserve bench` invocation (CLI flags use dashes)."""

    model_config = ConfigDict(extra="forbid")

    base_url: str = Field("http://127.0.0.1:8000", description="the server's root or its /v1 URL")
    model: str | None = Field(None, description="model id to request (default: the first of GET /v1/models)")
    endpoint: Literal["completions", "chat"] = Field("completions", description=(
        "/v1/completions with a text prompt, or /v1/chat/completions with one user message"))
    api_key: str | None = Field(None, description="sent as 'Authorization: Bearer KEY' (default: none)")
    tokenizer: str | None = Field(None, description=(
        "local HF tokenizer directory that counts prompt tokens exactly (default: --model if it is a local "
        "directory, else the model's `root` from /v1/models if local)"))
    prompt_tokens: int = Field(512, ge=1, description="tokens in each prompt")
    output_tokens: int = Field(128, ge=1, description="max_tokens of each request")
    shared_prefix_tokens: int = Field(0, ge=0, description=(
        "tokens that every prompt starts with (a shared system prompt: prefix-cache hits)"))
    num_prompts: list[int] = Field(default_factory=lambda: [100], description=(
        "requests per run: N for every run, or N1,N2,... one per concurrency"))
    concurrency: list[int] = Field(default_factory=lambda: [10], description=(
        "requests in flight: C or C1,C2,... for one run each; with --request-rate, the in-flight cap"))
    request_rate: float | None = Field(None, gt=0, description=(
        "Poisson arrivals in requests/s, inf for all at once (default: closed loop, a new request when one ends)"))
    warmup: int = Field(0, ge=0, description="requests sent first and not measured")
    seed: int = Field(0, description="seed of the prompts' random text and of the arrival times")
    temperature: float | None = Field(None, ge=0, description=(
        "sent with every request (e.g. 0 for greedy) (default: not sent, so the server's default applies, "
        "as `vllm bench serve` does)"))
    ignore_eos: bool = Field(True, description="every request generates all its output tokens (EOS does not end it)")
    timeout_s: float = Field(600.0, gt=0, description="seconds one request may take")
    label: str = Field("shardserve", description="the framework's name in tables and plot legends")
    csv: str | None = Field(None, description="append one row per run to this CSV (default: none)")
    json_path: str | None = Field(None, description="write summaries and per-request timings here (default: none)")
    plot: str | None = Field(None, description="PNG: throughput and TTFT p95 against concurrency (default: none)")
    progress: bool = Field(True, description="a progress bar per run on stderr")

    @model_validator(mode="after")
    def _check_lists(self) -> BenchArgs:
        if any(c < 1 for c in self.concurrency):
            raise ValueError(f"every concurrency must be >= 1, got {self.concurrency}")
        if any(n < 1 for n in self.num_prompts):
            raise ValueError(f"every num_prompts must be >= 1, got {self.num_prompts}")
        if len(self.num_prompts) not in (1, len(self.concurrency)):
            raise ValueError(
                f"--num-prompts takes one value or one per concurrency ({len(self.concurrency)}), "
                f"got {len(self.num_prompts)}"
            )
        return self

    def prompts_for_run(self, run_index: int) -> int:
        return self.num_prompts[run_index] if len(self.num_prompts) > 1 else self.num_prompts[0]


@dataclass
class BenchResult:
    """Everything one invocation measured: a summary and the request records per run."""

    summaries: list[RunSummary]
    records: list[list[RequestRecord]]


async def run_bench(args: BenchArgs) -> BenchResult:
    """Warm up, then one run per concurrency, each with its own fresh prompts; write the files asked for."""
    model, root = (args.model, None) if args.model else await first_model_id(args.base_url, args.api_key)
    builder = PromptBuilder(
        load_tokenizer(resolve_tokenizer_dir(args.tokenizer, model, root)),
        args.prompt_tokens,
        endpoint=args.endpoint,
        shared_prefix_tokens=args.shared_prefix_tokens,
        seed=args.seed,
    )
    client = OpenAIStreamClient(
        args.base_url,
        model,
        endpoint=args.endpoint,
        api_key=args.api_key,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        timeout_s=args.timeout_s,
        max_connections=max(args.concurrency + [args.warmup, 1]),
    )
    summaries, all_records = [], []
    try:
        if args.warmup:
            warm, _ = await run_load(client, _specs(builder, args.warmup, args), max(args.concurrency))
            failed = [r for r in warm if not r.ok]
            print(f"warmup: {len(warm) - len(failed)}/{len(warm)} succeeded", file=sys.stderr)
        for i, concurrency in enumerate(args.concurrency):
            specs = _specs(builder, args.prompts_for_run(i), args)
            records, wall_s = await _timed_run(client, specs, concurrency, args, seed=args.seed + i)
            settings = _settings(args, model, concurrency, len(specs))
            summary = RunSummary.from_records(records, wall_s, settings)
            print(format_details(summary), file=sys.stderr)
            summaries.append(summary)
            all_records.append(records)
    finally:
        await client.aclose()
    if args.csv:
        append_csv(args.csv, summaries)
    if args.json_path:
        write_json(args.json_path, summaries, all_records)
    if args.plot:
        plot(args.plot, summaries)
    return BenchResult(summaries=summaries, records=all_records)


def resolve_tokenizer_dir(tokenizer: str | None, model: str, root: str | None) -> str:
    """--tokenizer, else the model id when it is a local directory, else the server's `root` path if local."""
    for candidate in (tokenizer, model, root):
        if candidate and os.path.isdir(candidate):
            return candidate
    if tokenizer:
        return tokenizer  # load_tokenizer says it does not exist
    raise FileNotFoundError(
        f"no local tokenizer for model {model!r}: pass --tokenizer DIR (its Hugging Face directory) "
        "so prompt lengths can be counted exactly"
    )


def _specs(builder: PromptBuilder, num_prompts: int, args: BenchArgs) -> list[RequestSpec]:
    prompts = builder.build(num_prompts)
    return [RequestSpec(p, args.output_tokens, builder.count_tokens(p)) for p in prompts]


async def _timed_run(client, specs, concurrency: int, args: BenchArgs, seed: int):
    bar = None
    if args.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(specs), desc=f"{args.label} c={concurrency}", unit="req", file=sys.stderr)
    try:
        return await run_load(
            client,
            specs,
            max_concurrency=concurrency,
            request_rate=args.request_rate,
            seed=seed,
            on_done=(lambda _record: bar.update(1)) if bar else None,
        )
    finally:
        if bar:
            bar.close()


def _settings(args: BenchArgs, model: str, concurrency: int, num_prompts: int) -> dict:
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "label": args.label,
        "base_url": args.base_url,
        "model": model,
        "endpoint": args.endpoint,
        "concurrency": concurrency,
        "request_rate": args.request_rate,
        "num_prompts": num_prompts,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "shared_prefix_tokens": args.shared_prefix_tokens,
        "seed": args.seed,
    }


# ---- command line ---------------------------------------------------------------------------------------


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
    parser = argparse.ArgumentParser(prog="python -m app.bench")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
