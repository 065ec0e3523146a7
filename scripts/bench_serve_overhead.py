"""What the HTTP + Ray Serve path adds per request over the in-process engine (part of `make bench`).

At concurrency 1, for 1-token and 128-token requests (a 64-token prompt, greedy, ignore_eos),
times TTFT and total latency as the median of --repeats requests:
  (a) in process: `AsyncLLMEngine.generate()` on the same model and settings;
  (b) through `shardserve serve` (--http-ingress direct: the replica's own HTTP server; proxy: Ray Serve's
      proxy in front; then FastAPI, SSE) with a streaming /v1/completions request from an httpx client on 127.0.0.1.
The difference is the serving path's overhead (issue target: ≤ 5 ms on median TTFT).
Then under load: --load-prompts prompts of --load-prompt-tokens token ids → 128 tokens at concurrency
--load-concurrency, greedy and sampled (temperature 1.0), generated tokens per second (a) in process and
(b) through Serve (streamed, the same token-id prompts): the served/in-process ratio is what the whole
serving path costs at that load (issue target: ≥ 0.95 at concurrency 50, greedy).
Writes its tables into docs/BENCHMARKS.md with --write-doc.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import statistics
import time
from pathlib import Path

import httpx

from scripts.bench_serve import ServerProcess
from scripts.doc_blocks import rewrite_block

BEGIN, END = "<!-- serve-overhead:begin -->", "<!-- serve-overhead:end -->"


def prompts(count: int, length: int, vocab: int, seed: int = 0, min_length: int | None = None) -> list[list[int]]:
    """`count` prompts of random token ids: `length` each, or with `min_length` of lengths drawn from it to `length`."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length if min_length is None else rng.randint(min_length, length))]
            for _ in range(count)]


async def in_process(model_dir: str, dtype: str, prompt_ids, output_tokens: int) -> tuple[list, list]:
    from engine import AsyncLLMEngine, EngineConfig, SamplingParams

    engine = AsyncLLMEngine(EngineConfig(model=model_dir, dtype=dtype, max_model_len=1024))
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    ttfts, latencies = [], []
    try:
        for i, ids in enumerate([prompt_ids[0]] + prompt_ids):  # the first is a warm-up
            start = time.perf_counter()
            first = None
            async for delta in engine.generate(ids, params, f"r{output_tokens}-{i}"):
                if first is None and any(o.token_ids for o in delta.outputs):
                    first = time.perf_counter() - start
            if i:
                ttfts.append(first)
                latencies.append(time.perf_counter() - start)
    finally:
        engine.shutdown()
    return ttfts, latencies


async def in_process_load(engine, prompt_ids, output_tokens: int, concurrency: int, temperature: float) -> float:
    """Generated tokens per second with `concurrency` requests in flight, in process."""
    from engine import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=output_tokens, ignore_eos=True)
    queue = list(enumerate(prompt_ids))
    generated = 0

    async def client():
        nonlocal generated
        while queue:
            i, ids = queue.pop(0)
            async for delta in engine.generate(ids, params, f"load-{temperature}-{i}-{random.random()}"):
                generated += sum(len(o.token_ids) for o in delta.outputs)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return generated / (time.perf_counter() - start)


async def served_load(base_url: str, model: str, prompt_ids, output_tokens: int, concurrency: int,
                      temperature: float) -> float:
    """Generated tokens per second through the server, streamed, `concurrency` requests in flight."""
    body = {"model": model, "max_tokens": output_tokens, "temperature": temperature, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    queue = list(prompt_ids)
    generated = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:

        async def worker():
            nonlocal generated
            while queue:
                ids = queue.pop(0)
                async with client.stream("POST", "/v1/completions", json={**body, "prompt": ids}) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        if line.startswith("data: {") and '"usage"' in line:
                            usage = json.loads(line[6:]).get("usage")
                            if usage:
                                generated += usage["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return generated / (time.perf_counter() - start)


async def in_process_loads(model_dir: str, dtype: str, load_ids: dict, concurrency: int) -> dict[str, float]:
    from engine import AsyncLLMEngine, EngineConfig

    # the settings `shardserve serve` runs with on CPU (its 2048-token step budget)
    engine = AsyncLLMEngine(EngineConfig(model=model_dir, dtype=dtype, max_model_len=1024,
                                         max_num_batched_tokens=2048))
    try:
        await in_process_load(engine, load_ids["warm-up"], 2, concurrency, 1.0)
        return {mode: await in_process_load(engine, load_ids[mode], 128, concurrency, temperature)
                for mode, temperature in LOAD_MODES.items()}
    finally:
        engine.shutdown()


LOAD_MODES = {"greedy": 0.0, "sampled": 1.0}


def through_serve(base_url: str, model: str, prompt_ids, output_tokens: int) -> tuple[list, list]:
    body = {"model": model, "max_tokens": output_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}
    ttfts, latencies = [], []
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for i, ids in enumerate([prompt_ids[0]] + prompt_ids):
            start = time.perf_counter()
            first = None
            with client.stream("POST", "/v1/completions", json={**body, "prompt": ids}) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk["choices"] and chunk["choices"][0].get("text") is not None:
                        first = time.perf_counter() - start
            if i:
                ttfts.append(first)
                latencies.append(time.perf_counter() - start)
    return ttfts, latencies


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory (default: the random-weight bench-shaped model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--load-concurrency", type=int, default=50)
    parser.add_argument("--load-prompts", type=int, default=150)
    parser.add_argument("--load-prompt-tokens", type=int, default=512)
    parser.add_argument("--no-load", dest="load", action="store_false", help="concurrency 1 only")
    parser.add_argument("--http-ingress", default="direct,proxy",
                        help="the servers' --http-ingress, one served run each, in this order (default direct,proxy)")
    parser.add_argument("--write-doc", action="store_true")
    args = parser.parse_args(argv)

    from engine.checkpoint.random_model import ensure_bench_model

    model_dir = args.model or str(ensure_bench_model())
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    ids = prompts(args.repeats, args.prompt_tokens, vocab)
    # a prompt set per run: with prefix caching on (the server's default), a repeated set would skip its prefill
    load_ids = {name: prompts(args.load_prompts if name in LOAD_MODES else args.load_concurrency,
                              args.load_prompt_tokens, vocab, seed=seed)
                for seed, name in enumerate(["warm-up", *LOAD_MODES], start=1)}
    results = {}
    for output_tokens in (1, 128):
        results[("engine", output_tokens)] = asyncio.run(in_process(model_dir, args.dtype, ids, output_tokens))
    loads = {}
    if args.load:
        loads["engine"] = asyncio.run(in_process_loads(model_dir, args.dtype, load_ids, args.load_concurrency))
        print(f"in process: {loads['engine']}", flush=True)
    ingresses = args.http_ingress.split(",")
    for ingress in ingresses:
        server = ServerProcess(model_dir, extra_args=["--dtype", args.dtype, "--max-model-len", "1024",
                                                      "--http-ingress", ingress])
        with server.start(timeout_s=300):
            model = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
            for output_tokens in (1, 128):
                results[(ingress, output_tokens)] = through_serve(server.base_url, model, ids, output_tokens)
            if args.load:
                c = args.load_concurrency
                asyncio.run(served_load(server.base_url, model, load_ids["warm-up"], 2, c, 1.0))
                loads[ingress] = {
                    mode: asyncio.run(served_load(server.base_url, model, load_ids[mode], 128, c, temperature))
                    for mode, temperature in LOAD_MODES.items()
                }
                print(f"served ({ingress} ingress): {loads[ingress]}", flush=True)

    lines = [
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, 2-core CPU, model "
        f"{Path(model_dir).name} ({args.dtype}), {args.prompt_tokens}-token prompts, concurrency 1, "
        f"median of {args.repeats} requests each (after one warm-up).",
        "",
        "| HTTP ingress | output tokens | TTFT in-process ms | TTFT served ms | TTFT added ms | latency in-process ms "
        "| latency served ms | latency added ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ingress in ingresses:
        for output_tokens in (1, 128):
            e_ttft, e_lat = (statistics.median(v) * 1e3 for v in results[("engine", output_tokens)])
            s_ttft, s_lat = (statistics.median(v) * 1e3 for v in results[(ingress, output_tokens)])
            lines.append(
                f"| {ingress} | {output_tokens} | {e_ttft:.1f} | {s_ttft:.1f} | {s_ttft - e_ttft:+.1f} | {e_lat:.1f} | "
                f"{s_lat:.1f} | {s_lat - e_lat:+.1f} |"
            )
    if loads:
        lines += [
            "",
            f"Under load: {args.load_prompts} prompts of {args.load_prompt_tokens} token ids → 128 tokens, "
            f"concurrency {args.load_concurrency}, generated tok/s:",
            "",
            "| sampling | in process | " + " | ".join(f"served, {i} ingress" for i in ingresses) + " | "
            + " | ".join(f"{i} / in process" for i in ingresses) + " |",
            "|---|---|" + "---|" * (2 * len(ingresses)),
        ]
        for mode in LOAD_MODES:
            engine_tok_s = loads["engine"][mode]
            served = [loads[i][mode] for i in ingresses]
            lines.append(f"| {mode} | {engine_tok_s:.0f} | " + " | ".join(f"{v:.0f}" for v in served) + " | "
                         + " | ".join(f"{v / engine_tok_s:.2f}" for v in served) + " |")
    table = "\n".join(lines)
    print(table)
    if args.write_doc:
        body = f"{table}\n\nCommand: `python -m scripts.bench_serve_overhead --write-doc`"
        rewrite_block(BEGIN, END, body, "Serving path overhead")


if __name__ == "__main__":
    main()
