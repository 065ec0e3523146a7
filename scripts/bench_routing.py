"""Routing across replicas (issue 17), part of `make bench`: what the ingress's hop costs, and what prefix routing
buys over Ray Serve's default router. Everything runs on one local Ray (loopback only), one application at a
time, the bench model in bfloat16 where the CPU multiplies it natively (else float32), loads from `shardserve bench`'s own code at the server's default sampling
(temperature 1.0, as `vllm bench serve` sends no temperature).

Part 1, the hop: one replica, Serve's proxy straight to the replica against proxy -> ingress -> replica, random
512-token prompts -> 128 tokens at concurrency 10 and 50, alternated (direct, ingress, direct, ingress).
Part 2, the routers: two replicas (one core and one torch thread each), 16 distinct 1,024-token system prompts
(`--shared-prefix-tokens 1024 --num-shared-prefixes 16`), each request one of them drawn at random plus 64 tokens
of its own -> 64 tokens. Each replica's KV cache (--num-kv-blocks) holds a little more than 8 of the 16 prefixes
beside its running requests: the half that prefix routing sends it, but not every prefix. `--routing prefix`
against `--routing serve-default`: a closed loop at concurrency 8, then Poisson arrivals at 70% of the default
router's closed-loop request rate (equal throughput, so TTFT compares like for like). The prefix-cache hit rate
is the servers' own count (usage.prompt_tokens_details.cached_tokens over prompt tokens). Each run starts after
a warm-up of 32 requests that sees the prefixes once.

Prints markdown tables; with --write-doc rewrites the routing block of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import os
import platform
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from bench.report import RunSummary
from bench.run import BenchArgs, run_bench
from scripts.doc_blocks import rewrite_block

BEGIN, END = "<!-- routing-bench:begin -->", "<!-- routing-bench:end -->"
PREFIX_TOKENS, NUM_PREFIXES, OWN_TOKENS, OUTPUT_TOKENS = 1024, 16, 64, 64
BLOCK_SIZE = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_serve(num_cpus: int = 4) -> Iterator[str]:
    """A local Ray (every port on 127.0.0.1) with Serve's proxy on a free port; yields its base URL."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
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


def kv_blocks_for_half_the_prefixes(concurrency: int) -> int:
    """Blocks per replica: 8.5 prefixes' worth beside the running requests' own blocks (their prefix is shared)."""
    prefix_blocks = PREFIX_TOKENS // BLOCK_SIZE
    own_blocks = -(-(OWN_TOKENS + OUTPUT_TOKENS + BLOCK_SIZE) // BLOCK_SIZE)
    return int(8.5 * prefix_blocks) + concurrency * own_blocks


def routers(base_url: str, model_dir: str, dtype: str, num_prompts: int,
            concurrency: int) -> tuple[list[str], dict]:
    from app.config import ServeArgs
    from app.deployment import build_app

    num_kv_blocks = kv_blocks_for_half_the_prefixes(concurrency)

    def load(label: str, seed: int, rate: float | None = None) -> BenchArgs:
        return BenchArgs(base_url=base_url, model="bench", tokenizer=model_dir,
                         prompt_tokens=PREFIX_TOKENS + OWN_TOKENS, output_tokens=OUTPUT_TOKENS,
                         shared_prefix_tokens=PREFIX_TOKENS, num_shared_prefixes=NUM_PREFIXES,
                         num_prompts=[num_prompts], concurrency=[concurrency], request_rate=rate, warmup=32,
                         seed=seed, progress=False, label=label)

    def app(routing: str):
        return build_app(ServeArgs(model=model_dir, served_model_name="bench", dtype=dtype, max_model_len=2048,
                                   num_replicas=2, cpus_per_rank=1.0, cpu_threads=1, routing=routing,
                                   num_kv_blocks=num_kv_blocks, block_size=BLOCK_SIZE))

    closed: dict[str, RunSummary] = {}
    for routing in ("serve-default", "prefix"):
        print(f"routers, closed loop: {routing}", flush=True)
        [closed[routing]] = run_app(base_url, app(routing), [load(routing, seed=1)])
    rate = round(0.7 * closed["serve-default"].request_throughput, 2)
    paced: dict[str, RunSummary] = {}
    for routing in ("serve-default", "prefix"):
        print(f"routers, {rate} req/s: {routing}", flush=True)
        [paced[routing]] = run_app(base_url, app(routing), [load(routing, seed=2, rate=rate)])
    lines = ["| load | router | prefix-cache hit rate | output tok/s | req/s | TTFT mean ms | TTFT p95 ms "
             "| TPOT mean ms | failed |", "|---|---|---|---|---|---|---|---|---|"]
    for name, runs in ((f"closed loop, concurrency {concurrency}", closed), (f"Poisson {rate} req/s", paced)):
        for routing in ("serve-default", "prefix"):
            s = runs[routing]
            lines.append(f"| {name} | {routing} | {100 * s.prefix_cache_hit_rate:.1f}% | {s.output_throughput:.0f} | "
                         f"{s.request_throughput:.2f} | {s.ttft_mean_ms:.0f} | {s.ttft_p95_ms:.0f} | "
                         f"{s.tpot_mean_ms:.1f} | {s.failures} |")
    ratios = {
        "hit rate (closed loop)": closed["prefix"].prefix_cache_hit_rate / closed["serve-default"].prefix_cache_hit_rate,
        "throughput (closed loop)": closed["prefix"].output_throughput / closed["serve-default"].output_throughput,
        f"TTFT p95 at {rate} req/s": paced["prefix"].ttft_p95_ms / paced["serve-default"].ttft_p95_ms,
        f"TTFT mean at {rate} req/s": paced["prefix"].ttft_mean_ms / paced["serve-default"].ttft_mean_ms,
    }
    lines += ["", "prefix / serve-default: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()),
              "", f"KV cache per replica: {num_kv_blocks} blocks of {BLOCK_SIZE} tokens "
              f"({num_kv_blocks * BLOCK_SIZE / PREFIX_TOKENS:.1f} prefixes' worth, running requests included)."]
    return lines, ratios


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory (default: the random-weight bench model)")
    parser.add_argument("--hop-rounds", type=int, default=2, help="alternated rounds of the hop measurement")
    parser.add_argument("--prompts", type=int, default=160, help="measured requests per router run")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--no-hop", dest="hop", action="store_false")
    parser.add_argument("--no-routers", dest="routers", action="store_false")
    parser.add_argument("--write-doc", action="store_true")
    args = parser.parse_args(argv)

    from engine.random_model import ensure_bench_model
    from kernels.backend import cpu_supports_bf16

    model_dir = args.model or str(ensure_bench_model())
    dtype = "bfloat16" if cpu_supports_bf16() else "float32"
    sections = [f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {platform.machine()} "
                f"({platform.processor() or 'CPU'}), {os.cpu_count()} cores, model {os.path.basename(model_dir)} "
                f"({dtype}), sampled at the server's default (temperature 1.0)."]
    with local_serve() as base_url:
        if args.hop:
            sections += ["", f"**The ingress's hop**, one replica, 512 -> 128 tokens, mean of {args.hop_rounds} "
                         "alternated rounds:", "", *hop_cost(base_url, model_dir, dtype, args.hop_rounds)]
        if args.routers:
            lines, _ = routers(base_url, model_dir, dtype, args.prompts, args.concurrency)
            sections += ["", f"**Prefix routing against Serve's default router**, 2 replicas, {NUM_PREFIXES} "
                         f"system prompts of {PREFIX_TOKENS} tokens + {OWN_TOKENS} own -> {OUTPUT_TOKENS} tokens, "
                         f"{args.prompts} requests per run after 32 warm-up:", "", *lines]
    body = "\n".join(sections + ["", "Command: `python -m scripts.bench_routing --write-doc` (in `make bench`)"])
    print(body)
    if args.write_doc:
        rewrite_block(BEGIN, END, body, "Routing across replicas")


def _mean(summaries: list[RunSummary], name: str) -> float:
    return sum(getattr(s, name) for s in summaries) / len(summaries)


if __name__ == "__main__":
    main()
