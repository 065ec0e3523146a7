"""Routing across replicas (issue 17), part of `make bench`: what the ingress's hop costs, and what prefix routing
buys over Ray Serve's default router. Everything runs on one local Ray (loopback only), one application at a
time, the bench model in bfloat16 where the CPU multiplies it natively (else float32), loads from `shardserve bench`'s own code at the server's default sampling
(temperature 1.0, as `vllm bench serve` sends no temperature).

Part 1, the hop: one replica, Serve's proxy straight to the replica against proxy -> ingress -> replica, random
512-token prompts -> 128 tokens at concurrency 10 and 50, alternated (direct, ingress, direct, ingress).
Part 2, the routers: two replicas (one core and one torch thread each), 16 distinct 1,024-token system prompts
(`--shared-prefix-tokens 1024 --num-shared-prefixes 16`), each request one of them drawn at random plus 64 tokens
of its own -> 64 tokens. Each replica's KV cache (--num-kv-blocks) holds, beside its running requests, 6 of the
16 prefixes (fewer than the 8 that prefix routing sends each replica) or 10 (more than 8, fewer than 16): never
every prefix. `--routing prefix` against `--routing serve-default` at both sizes: a closed loop at concurrency 8,
then Poisson arrivals at 70% of the default router's closed-loop request rate (the smaller cache's), at both
sizes (equal throughput, so TTFT compares like for like). The prefix-cache hit rate is the servers' own count
(usage.prompt_tokens_details.cached_tokens over prompt tokens). Each run starts after a warm-up of 64 requests
(all 16 prefixes seen, nearly always), so the figures are the steady state.

Prints markdown tables; with --write-doc rewrites the routing block of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before anything imports Ray: every port on 127.0.0.1

import argparse
import asyncio
import datetime
import logging
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager

from bench.report import RunSummary
from bench.run import BenchArgs, run_bench
from scripts.doc_blocks import rewrite_block
from scripts.ports import free_port

BEGIN, END = "<!-- routing-bench:begin -->", "<!-- routing-bench:end -->"
PREFIX_TOKENS, NUM_PREFIXES, OWN_TOKENS, OUTPUT_TOKENS = 1024, 16, 64, 64
BLOCK_SIZE = 16


@contextmanager
def local_serve(num_cpus: int = 4) -> Iterator[str]:
    """A local Ray (every port on 127.0.0.1) with Serve's proxy on a free port; yields its base URL."""
    from app.proxy_errors import use_openai_errors_in_serve_proxy

    use_openai_errors_in_serve_proxy()
    import ray
    from ray import serve

    ray.init(address="local", include_dashboard=False, num_cpus=num_cpus, logging_level=logging.WARNING,
             log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def run_app(base_url: str, app, loads: list[BenchArgs]) -> list[RunSummary]:
    """Deploy `app` at "/", run each load against it, delete it."""
    from ray import serve

    started = time.monotonic()
    serve.run(app, name="bench", route_prefix="/")
    print(f"  up in {time.monotonic() - started:.0f} s", flush=True)
    try:
        summaries = [asyncio.run(run_bench(load)).summaries[0] for load in loads]
        print(routing_report(base_url), flush=True)
        return summaries
    finally:
        serve.delete("bench")


def routing_report(base_url: str) -> str:
    """Where the ingress's router sent requests, per replica and reason, and each replica's prefix-cache hits
    ("" without an ingress)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    if "shardserve:routing_decisions_total" not in text:
        return ""
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    lines = []
    for replica in sorted({s.labels["replica"] for s in samples if "replica" in s.labels}):
        reasons = {s.labels["reason"]: int(s.value) for s in samples
                   if s.name == "shardserve:routing_decisions_total" and s.labels["replica"] == replica}
        cache = {s.name.rsplit("_", 2)[-2]: s.value for s in samples if s.labels.get("replica") == replica
                 and s.name.startswith("shardserve:replica_prefix_cache_")}
        hit = cache.get("hits", 0) / cache["queries"] if cache.get("queries") else float("nan")
        lines.append(f"  replica {replica}: {reasons}, its prefix-cache hit rate {100 * hit:.1f}%")
    return "\n".join(lines)


def hop_cost(base_url: str, model_dir: str, dtype: str, rounds: int) -> list[str]:
    from app.config import ServeArgs
    from app.deployment import build_app

    args = ServeArgs(model=model_dir, served_model_name="bench", dtype=dtype, max_model_len=1024,
                     num_replicas=1, cpus_per_rank=1.0)
    loads = [BenchArgs(base_url=base_url, model="bench", tokenizer=model_dir, prompt_tokens=512, output_tokens=128,
                       num_prompts=[prompts], concurrency=[concurrency], warmup=8, seed=seed, progress=False,
                       label="x")
             for seed, (concurrency, prompts) in enumerate(((10, 60), (50, 150)))]
    results: dict[str, list[list[RunSummary]]] = {"direct": [], "ingress": []}
    for round_index in range(rounds):
        for path in results:
            print(f"hop, round {round_index + 1}: {path}", flush=True)
            reseeded = [load.model_copy(update={"seed": load.seed + 100 * round_index}) for load in loads]
            results[path].append(run_app(base_url, build_app(args, ingress=path == "ingress"), reseeded))
    lines = ["| concurrency | direct tok/s | via ingress tok/s | ratio | TTFT p95 direct / ingress ms "
             "| TPOT mean direct / ingress ms |", "|---|---|---|---|---|---|"]
    for i, load in enumerate(loads):
        direct = [r[i] for r in results["direct"]]
        ingress = [r[i] for r in results["ingress"]]
        d_tok, i_tok = _mean(direct, "output_throughput"), _mean(ingress, "output_throughput")
        lines.append(
            f"| {load.concurrency[0]} | {d_tok:.0f} | {i_tok:.0f} | {i_tok / d_tok:.2f}x | "
            f"{_mean(direct, 'ttft_p95_ms'):.0f} / {_mean(ingress, 'ttft_p95_ms'):.0f} | "
            f"{_mean(direct, 'tpot_mean_ms'):.1f} / {_mean(ingress, 'tpot_mean_ms'):.1f} |")
    return lines


def kv_blocks_for(prefixes: int, concurrency: int) -> int:
    """Blocks per replica: `prefixes` prefixes' worth beside the running requests' own blocks."""
    own_blocks = -(-(OWN_TOKENS + OUTPUT_TOKENS + BLOCK_SIZE) // BLOCK_SIZE)
    return prefixes * (PREFIX_TOKENS // BLOCK_SIZE) + concurrency * own_blocks


def routers(base_url: str, model_dir: str, dtype: str, num_prompts: int, concurrency: int,
            cache_prefixes: tuple[int, int]) -> list[str]:
    from app.config import ServeArgs
    from app.deployment import build_app

    def load(label: str, seed: int, rate: float | None = None) -> BenchArgs:
        return BenchArgs(base_url=base_url, model="bench", tokenizer=model_dir,
                         prompt_tokens=PREFIX_TOKENS + OWN_TOKENS, output_tokens=OUTPUT_TOKENS,
                         shared_prefix_tokens=PREFIX_TOKENS, num_shared_prefixes=NUM_PREFIXES,
                         num_prompts=[num_prompts], concurrency=[concurrency], request_rate=rate, warmup=64,
                         seed=seed, progress=False, label=label)

    def app(routing: str, prefixes: int):
        return build_app(ServeArgs(model=model_dir, served_model_name="bench", dtype=dtype, max_model_len=2048,
                                   num_replicas=2, cpus_per_rank=1.0, cpu_threads=1, routing=routing,
                                   num_kv_blocks=kv_blocks_for(prefixes, concurrency), block_size=BLOCK_SIZE))

    runs: list[tuple[str, int, dict[str, RunSummary]]] = []
    small, large = cache_prefixes
    for prefixes in (small, large):
        closed: dict[str, RunSummary] = {}
        for routing in ("serve-default", "prefix"):
            print(f"routers, closed loop, cache of {prefixes} prefixes: {routing}", flush=True)
            [closed[routing]] = run_app(base_url, app(routing, prefixes), [load(routing, seed=1)])
        runs.append((f"closed loop, concurrency {concurrency}", prefixes, closed))
    rate = round(0.7 * runs[0][2]["serve-default"].request_throughput, 2)  # both routers keep up with it
    for prefixes in (small, large):
        paced: dict[str, RunSummary] = {}
        for routing in ("serve-default", "prefix"):
            print(f"routers, {rate} req/s, cache of {prefixes} prefixes: {routing}", flush=True)
            [paced[routing]] = run_app(base_url, app(routing, prefixes), [load(routing, seed=2, rate=rate)])
        runs.append((f"Poisson {rate} req/s", prefixes, paced))

    lines = ["| load | cache holds | router | prefix-cache hit rate | output tok/s | req/s | TTFT mean ms "
             "| TTFT p95 ms | TPOT mean ms | failed |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, prefixes, by_router in runs:
        for routing in ("serve-default", "prefix"):
            s = by_router[routing]
            lines.append(f"| {name} | {prefixes} of {NUM_PREFIXES} prefixes | {routing} | "
                         f"{100 * s.prefix_cache_hit_rate:.1f}% | {s.output_throughput:.0f} | "
                         f"{s.request_throughput:.2f} | {s.ttft_mean_ms:.0f} | {s.ttft_p95_ms:.0f} | "
                         f"{s.tpot_mean_ms:.1f} | {s.failures} |")
    lines.append("")
    for name, prefixes, by_router in runs:
        prefix, default = by_router["prefix"], by_router["serve-default"]
        lines.append(
            f"- {name}, cache of {prefixes} prefixes: prefix / serve-default hit rate "
            f"{prefix.prefix_cache_hit_rate / default.prefix_cache_hit_rate:.2f}x, throughput "
            f"{prefix.output_throughput / default.output_throughput:.2f}x, TTFT mean "
            f"{prefix.ttft_mean_ms / default.ttft_mean_ms:.2f}x, TTFT p95 {prefix.ttft_p95_ms / default.ttft_p95_ms:.2f}x")
    lines += ["", f"KV cache per replica: {kv_blocks_for(small, concurrency)} or {kv_blocks_for(large, concurrency)} "
              f"blocks of {BLOCK_SIZE} tokens ({small} or {large} prefixes plus {concurrency} requests' own blocks)."]
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory (default: the random-weight bench model)")
    parser.add_argument("--hop-rounds", type=int, default=2, help="alternated rounds of the hop measurement")
    parser.add_argument("--prompts", type=int, default=160, help="measured requests per router run")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--cache-prefixes", type=int, nargs=2, default=(6, 10), metavar=("SMALL", "LARGE"),
                        help="prefixes each replica's KV cache holds beside its running requests, in two runs")
    parser.add_argument("--no-hop", dest="hop", action="store_false")
    parser.add_argument("--no-routers", dest="routers", action="store_false")
    parser.add_argument("--write-doc", action="store_true")
    args = parser.parse_args(argv)

    from engine.checkpoint.random_model import ensure_bench_model
    from kernels.backend import cpu_supports_bf16

    model_dir = args.model or str(ensure_bench_model())
    dtype = "bfloat16" if cpu_supports_bf16() else "float32"
    sections = [f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {platform.machine()} "
                f"({cpu_model()}), {os.cpu_count()} cores, model {os.path.basename(model_dir)} "
                f"({dtype}), sampled at the server's default (temperature 1.0)."]
    with local_serve() as base_url:
        if args.hop:
            sections += ["", f"**The ingress's hop**, one replica, 512 -> 128 tokens, mean of {args.hop_rounds} "
                         "alternated rounds:", "", *hop_cost(base_url, model_dir, dtype, args.hop_rounds)]
        if args.routers:
            lines = routers(base_url, model_dir, dtype, args.prompts, args.concurrency, tuple(args.cache_prefixes))
            sections += ["", f"**Prefix routing against Serve's default router**, 2 replicas, {NUM_PREFIXES} "
                         f"system prompts of {PREFIX_TOKENS} tokens + {OWN_TOKENS} own -> {OUTPUT_TOKENS} tokens, "
                         f"{args.prompts} requests per run after 64 warm-up:", "", *lines]
    body = "\n".join(sections + ["", "Command: `python -m scripts.bench_routing --write-doc` (in `make bench`)"])
    print(body)
    if args.write_doc:
        rewrite_block(BEGIN, END, body, "Routing across replicas")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def _mean(summaries: list[RunSummary], name: str) -> float:
    return sum(getattr(s, name) for s in summaries) / len(summaries)


if __name__ == "__main__":
    main()
