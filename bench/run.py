"""One `shardserve bench` invocation: its settings, and a warmup then one measured run per concurrency."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from tqdm import tqdm

from bench.client import OpenAIStreamClient, RequestResult, RequestSpec, first_model_id, run_load
from bench.grounded import GroundedPromptBuilder, write_custom_dataset
from bench.prompts import PromptBuilder, load_tokenizer
from bench.report import RunSummary, append_csv, format_details, plot, write_json
from bench.server_metrics import acceptance_between, scrape_spec_decode_counters


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
    dataset_name: Literal["random", "grounded"] = Field("random", description=(
        "the prompts (vLLM's flag): random token ids, or grounded, the model asked through its chat template to "
        "repeat or lightly edit a passage of Python source of the standard library (bench/grounded.py)"))
    save_dataset: str | None = Field(None, description=(
        "write the measured runs' grounded prompts here as JSONL, the same prompts for `vllm bench serve "
        "--dataset-name custom --dataset-path PATH --custom-output-len N --disable-shuffle` (default: none)"))
    prompt_tokens: int = Field(512, ge=1, description="tokens in each prompt")
    output_tokens: int = Field(128, ge=1, description="max_tokens of each request")
    shared_prefix_tokens: int = Field(0, ge=0, description=(
        "tokens that every prompt starts with (a shared system prompt: prefix-cache hits)"))
    num_shared_prefixes: int = Field(1, ge=1, description=(
        "distinct shared prefixes of --shared-prefix-tokens each; every prompt starts with one of them, drawn at "
        "random (several system prompts: what routing by prefix across replicas is for)"))
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
    extra_body: dict[str, Any] | None = Field(None, description=(
        "JSON object merged into every request's body, as `vllm bench serve --extra-body` does, e.g. a "
        "response_format (default: none)"))
    timeout_s: float = Field(600.0, gt=0, description="seconds one request may take")
    label: str = Field("shardserve", description="the framework's name in tables and plot legends")
    csv: str | None = Field(None, description="append one row per run to this CSV (default: none)")
    json_path: str | None = Field(None, description="write summaries and per-request timings here (default: none)")
    plot: str | None = Field(None, description="PNG: throughput and TTFT p95 against concurrency (default: none)")
    progress: bool = Field(True, description="a progress bar per run on stderr")

    @model_validator(mode="after")
    def _check_lists(self) -> BenchArgs:
        if self.dataset_name == "grounded" and self.shared_prefix_tokens:
            raise ValueError("--shared-prefix-tokens builds random prompts; the grounded dataset has none")
        if self.save_dataset and self.dataset_name != "grounded":
            raise ValueError("--save-dataset writes the grounded dataset (vLLM has its own random one)")
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
    """Everything one invocation measured: a summary and the request results per run."""

    summaries: list[RunSummary]
    records: list[list[RequestResult]]


async def run_bench(args: BenchArgs) -> BenchResult:
    """Warm up, then one run per concurrency, each with its own fresh prompts; write the files asked for."""
    model, root = (args.model, None) if args.model else await first_model_id(args.base_url, args.api_key)
    builder = prompt_builder(args, load_tokenizer(resolve_tokenizer_dir(args.tokenizer, model, root)))
    warmup_prompts, run_prompts = draw_prompts(builder, args)
    if args.save_dataset:
        write_custom_dataset(args.save_dataset, [p for run in run_prompts for p in run], args.output_tokens)
    client = OpenAIStreamClient(
        args.base_url,
        model,
        endpoint=args.endpoint,
        api_key=args.api_key,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        extra_body=args.extra_body,
        timeout_s=args.timeout_s,
        max_connections=max(args.concurrency + [args.warmup, 1]),
    )
    summaries, all_records = [], []
    try:
        if args.warmup:
            warm, _ = await run_load(client, _specs(builder, warmup_prompts, args), max(args.concurrency))
            failed = [r for r in warm if not r.ok]
            print(f"warmup: {len(warm) - len(failed)}/{len(warm)} succeeded", file=sys.stderr)
        server_url = client.base_url.removesuffix("/v1")
        for i, concurrency in enumerate(args.concurrency):
            specs = _specs(builder, run_prompts[i], args)
            before = await scrape_spec_decode_counters(client.http, server_url)
            records, wall_s = await _timed_run(client, specs, concurrency, args, seed=args.seed + i)
            accepted = acceptance_between(before, await scrape_spec_decode_counters(client.http, server_url))
            settings = _settings(args, model, concurrency, len(specs))
            summary = RunSummary.from_records(records, wall_s, settings)
            if accepted is not None:  # the server speculates: its acceptance over this run
                summary.spec_acceptance_rate, summary.spec_acceptance_length = accepted.rate, accepted.length
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


def prompt_builder(args: BenchArgs, tokenizer) -> PromptBuilder | GroundedPromptBuilder:
    """The builder of --dataset-name's prompts for --endpoint, seeded with --seed."""
    if args.dataset_name == "grounded":
        return GroundedPromptBuilder(tokenizer, args.prompt_tokens, endpoint=args.endpoint, seed=args.seed)
    return PromptBuilder(
        tokenizer,
        args.prompt_tokens,
        endpoint=args.endpoint,
        shared_prefix_tokens=args.shared_prefix_tokens,
        num_shared_prefixes=args.num_shared_prefixes,
        seed=args.seed,
    )


def draw_prompts(builder: PromptBuilder | GroundedPromptBuilder, args: BenchArgs) -> tuple[list[str], list[list[str]]]:
    """The warm-up's prompts and each run's, drawn in that order: the same settings always give the same."""
    warmup = builder.build(args.warmup)
    return warmup, [builder.build(args.prompts_for_run(i)) for i in range(len(args.concurrency))]


def save_dataset(args: BenchArgs, path: str) -> None:
    """Write the grounded prompts that `run_bench(args)` measures, without a server (--tokenizer is needed):
    the JSONL of --save-dataset, for `vllm bench serve --dataset-name custom` on the same prompts."""
    if args.dataset_name != "grounded" or args.tokenizer is None:
        raise ValueError("save_dataset writes the grounded dataset, and needs args.tokenizer (no server is asked)")
    builder = prompt_builder(args, load_tokenizer(args.tokenizer))
    _, run_prompts = draw_prompts(builder, args)
    write_custom_dataset(path, [p for run in run_prompts for p in run], args.output_tokens)


def _specs(builder: PromptBuilder | GroundedPromptBuilder, prompts: list[str], args: BenchArgs) -> list[RequestSpec]:
    sent = [builder.render(p) for p in prompts]
    return [RequestSpec(p, args.output_tokens, builder.count_tokens(p)) for p in sent]


async def _timed_run(client, specs, concurrency: int, args: BenchArgs, seed: int):
    bar = None
    if args.progress:
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
        "dataset_name": args.dataset_name,
        "concurrency": concurrency,
        "request_rate": args.request_rate,
        "num_prompts": num_prompts,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "shared_prefix_tokens": args.shared_prefix_tokens,
        "num_shared_prefixes": args.num_shared_prefixes if args.shared_prefix_tokens else 0,
        "seed": args.seed,
    }
