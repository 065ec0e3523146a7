"""What the HTTP + Ray Serve path adds per request over the in-process engine (part of `make bench`).

At concurrency 1, for 1-token and 128-token requests (a 64-token prompt, greedy, ignore_eos),
times TTFT and total latency as the median of --repeats requests:
  (a) in process: `AsyncLLMEngine.generate()` on the same model and settings;
  (b) through `shardserve serve` (Ray Serve proxy, replica, FastAPI, SSE) with a streaming
      /v1/completions request from an httpx client on 127.0.0.1.
The difference is the serving path's overhead (issue target: ≤ 5 ms on median TTFT).
Writes its table into docs/BENCHMARKS.md with --write-doc.
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


def prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


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
    parser.add_argument("--model", default=None, help="HF directory (default: the bench-shaped demo model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--write-doc", action="store_true")
    args = parser.parse_args(argv)

    from engine.demo_model import ensure_demo_model

    model_dir = args.model or str(ensure_demo_model())
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    ids = prompts(args.repeats, args.prompt_tokens, vocab)
    results = {}
    for output_tokens in (1, 128):
        results[("engine", output_tokens)] = asyncio.run(in_process(model_dir, args.dtype, ids, output_tokens))
    server = ServerProcess(model_dir, extra_args=["--dtype", args.dtype, "--max-model-len", "1024"])
    with server.start(timeout_s=300):
        model = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        for output_tokens in (1, 128):
            results[("serve", output_tokens)] = through_serve(server.base_url, model, ids, output_tokens)

    lines = [
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, 2-core CPU, model "
        f"{Path(model_dir).name} ({args.dtype}), {args.prompt_tokens}-token prompts, concurrency 1, "
        f"median of {args.repeats} requests each (after one warm-up).",
        "",
        "| output tokens | TTFT in-process ms | TTFT through Serve ms | TTFT added ms | latency in-process ms "
        "| latency through Serve ms | latency added ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for output_tokens in (1, 128):
        e_ttft, e_lat = (statistics.median(v) * 1e3 for v in results[("engine", output_tokens)])
        s_ttft, s_lat = (statistics.median(v) * 1e3 for v in results[("serve", output_tokens)])
        lines.append(
            f"| {output_tokens} | {e_ttft:.1f} | {s_ttft:.1f} | {s_ttft - e_ttft:+.1f} | {e_lat:.1f} | "
            f"{s_lat:.1f} | {s_lat - e_lat:+.1f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.write_doc:
        body = f"{table}\n\nCommand: `python -m scripts.bench_serve_overhead --write-doc`"
        rewrite_block(BEGIN, END, body, "Serving path overhead")

if __name__ == "__main__":
    main()
