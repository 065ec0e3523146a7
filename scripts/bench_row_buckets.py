"""What oneDNN's primitive per row count costs a step, and what the row-count buckets save (part of `make bench`).

    python -m scripts.bench_row_buckets [--write-doc]

oneDNN builds a matmul primitive for each row count its packed products meet (kernels/linear.py padded_rows).
Two measurements, each with the buckets on and off (SHARDSERVE_LINEAR_ROW_BUCKETS=0, each in a process of its own,
alternated --rounds times):
- a product: the bench model's four projection weights (bfloat16 where oneDNN packs it, else float32), timed at
  row counts it has not met and again at the same counts (the second call finds the primitive in the cache);
- the engine in process: --prompts prompts, each of a length drawn from --min-tokens..--max-tokens (so most are
  lengths no earlier prompt had), one at a time (concurrency 1, one output token): time to the first token, median
  and p95; then --load-prompts such prompts at concurrency --load-concurrency, 128 tokens each, sampled: generated
  tokens per second.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scripts.doc_blocks import cpu_description, rewrite_block

BEGIN, END = "<!-- row-buckets:begin -->", "<!-- row-buckets:end -->"
REPO = Path(__file__).resolve().parents[1]
ROW_COUNTS = {"~500": range(500, 532), "~2000": range(2000, 2032)}  # each met once, in turn


def product_times(model_dir: str, dtype_name: str) -> dict:
    """ms of the four projections' packed products, the mean over each range of ROW_COUNTS (each row count met
    once), and the same products on the last row count again (its primitive cached)."""
    import torch

    from engine.checkpoint.model_config import load_model_config
    from kernels.linear import PackedLinearWeight

    config = load_model_config(model_dir)
    dtype = getattr(torch, dtype_name)
    hidden, head_dim = config.hidden_size, config.head_dim
    shapes = [((config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim, hidden),
              (hidden, config.num_attention_heads * head_dim), (2 * config.intermediate_size, hidden),
              (hidden, config.intermediate_size)]
    weights = [PackedLinearWeight(torch.randn(out, inp).to(dtype)) for out, inp in shapes]
    result = {}
    for name, counts in ROW_COUNTS.items():
        times = []
        for rows in [*counts, counts[-1]]:
            inputs = [torch.randn(rows, inp).to(dtype) for _, inp in shapes]
            start = time.perf_counter()
            for weight, x in zip(weights, inputs, strict=True):
                weight.matmul(x, None)
            times.append((time.perf_counter() - start) * 1e3)
        result[name] = [statistics.mean(times[:-1]), times[-1]]
    return result


async def engine_times(model_dir: str, dtype: str, args) -> dict:
    from engine import AsyncLLMEngine, EngineConfig, SamplingParams
    from engine.checkpoint.model_config import load_model_config
    from scripts.bench_serve_overhead import prompts

    vocab = load_model_config(model_dir).vocab_size

    def spread(count: int, seed: int) -> list[list[int]]:
        return prompts(count, args.max_tokens, vocab, seed=seed, min_length=args.min_tokens)

    async def run(prompts, concurrency: int, params) -> tuple[float, list[float]]:
        queue, generated, ttfts = list(enumerate(prompts)), 0, []

        async def client():
            nonlocal generated
            while queue:
                i, ids = queue.pop(0)
                start, first = time.perf_counter(), None
                async for delta in engine.generate(ids, params, f"b{concurrency}-{i}"):
                    count = sum(len(o.token_ids) for o in delta.outputs)
                    if count and first is None:
                        first = time.perf_counter() - start
                        ttfts.append(first * 1e3)
                    generated += count

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return generated / (time.perf_counter() - start), sorted(ttfts)

    # the settings `shardserve serve` runs with on CPU (its 2048-token step budget); prefix caching off, as the
    # prompts are random anyway
    engine = AsyncLLMEngine(EngineConfig(model=model_dir, dtype=dtype, max_model_len=1024,
                                         max_num_batched_tokens=2048, enable_prefix_caching=False))
    try:
        await run([[5] * 64], 1, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
        _, ttfts = await run(spread(args.prompts, args.seed), 1,
                             SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        tok_s, _ = await run(spread(args.load_prompts, args.seed + 1000), args.load_concurrency,
                             SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True))
    finally:
        engine.shutdown()
    return {"ttft_median": statistics.median(ttfts), "ttft_p95": ttfts[int(0.95 * (len(ttfts) - 1))],
            "tok_s": tok_s}


def child(args) -> None:
    from engine.checkpoint.random_model import ensure_bench_model
    from kernels.backend import cpu_supports_bf16
    from kernels.host_memory import reuse_freed_memory
    from kernels.linear import padded_rows

    reuse_freed_memory()  # as the engine's model runner does, so the product times see the engine's malloc
    model_dir = args.model or str(ensure_bench_model())
    dtype = "bfloat16" if cpu_supports_bf16() else "float32"
    result = {"dtype": dtype, "buckets": padded_rows(517) != 517, "products": product_times(model_dir, dtype)}
    result.update(asyncio.run(engine_times(model_dir, dtype, args)))
    print("RESULT " + json.dumps(result), flush=True)


def measure(buckets: bool, argv: list[str]) -> dict:
    env = {**os.environ, "SHARDSERVE_LINEAR_ROW_BUCKETS": "1" if buckets else "0"}
    done = subprocess.run([sys.executable, "-m", "scripts.bench_row_buckets", "--child", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"bench_row_buckets child failed ({done.returncode}):\n{done.stderr[-3000:]}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF directory (default: the random-weight bench-shaped model)")
    parser.add_argument("--prompts", type=int, default=160)
    parser.add_argument("--min-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=768)
    parser.add_argument("--load-prompts", type=int, default=150)
    parser.add_argument("--load-concurrency", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write-doc", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return
    forwarded = [f"--prompts={args.prompts}", f"--min-tokens={args.min_tokens}", f"--max-tokens={args.max_tokens}",
                 f"--load-prompts={args.load_prompts}", f"--load-concurrency={args.load_concurrency}",
                 *([f"--model={args.model}"] if args.model else [])]
    load_before = os.getloadavg()[0]
    runs = []
    for round_ in range(args.rounds):
        for buckets in (False, True):
            result = measure(buckets, [*forwarded, f"--seed={args.seed + round_}"])
            assert result["buckets"] == buckets, "the child did not see SHARDSERVE_LINEAR_ROW_BUCKETS"
            runs.append(result)
            print(f"buckets {'on ' if buckets else 'off'} TTFT median {result['ttft_median']:.1f} ms "
                  f"p95 {result['ttft_p95']:.1f} ms, {result['tok_s']:.0f} tok/s at {args.load_concurrency}", flush=True)
    on = [r for r in runs if r["buckets"]]
    off = [r for r in runs if not r["buckets"]]

    def products(result: dict) -> str:
        return " | ".join(f"{mean:.2f} | {again:.2f}" for mean, again in result["products"].values())

    def cells(results: list[dict], key: str, fmt: str) -> str:
        return ", ".join(format(r[key], fmt) for r in results)

    lines = [
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_description()}, load average "
        f"{load_before:.1f} before the run: {'the bench model' if not args.model else Path(args.model).name} in "
        f"{runs[0]['dtype']}, buckets off and on alternated "
        f"{args.rounds} times, each in a process of its own.",
        "",
        "A layer's four projections (packed products), ms: the mean over 32 row counts in turn, each met once "
        "(500-531 and 2000-2031 rows), and the last of them again, its primitive built:",
        "",
        "| buckets | 500-531 rows | again | 2000-2031 rows | again |",
        "|---|---|---|---|---|",
        *(f"| {'on' if r['buckets'] else 'off'} | {products(r)} |" for r in runs),
        "",
        f"The engine in process (2048-token step budget, prefix caching off): {args.prompts} prompts of "
        f"{args.min_tokens}-{args.max_tokens} random tokens one at a time (TTFT, one output token), then "
        f"{args.load_prompts} at concurrency {args.load_concurrency} (128 tokens each, temperature 1.0):",
        "",
        "| buckets | TTFT median ms | TTFT p95 ms | tok/s at concurrency " + str(args.load_concurrency) + " |",
        "|---|---|---|---|",
        f"| off | {cells(off, 'ttft_median', '.1f')} | {cells(off, 'ttft_p95', '.1f')} | {cells(off, 'tok_s', '.0f')} |",
        f"| on | {cells(on, 'ttft_median', '.1f')} | {cells(on, 'ttft_p95', '.1f')} | {cells(on, 'tok_s', '.0f')} |",
        "",
        "Command: `python -m scripts.bench_row_buckets --write-doc` (in `make bench`)",
    ]
    print("\n".join(lines))
    if args.write_doc:
        rewrite_block(BEGIN, END, "\n".join(lines), "oneDNN's primitive per row count")


if __name__ == "__main__":
    main()
