"""Prefix caching and swap preemption benchmark (offline, through AsyncLLMEngine on the bench model).

Workload A (shared prefix): every prompt is the same `--shared` random tokens followed by
`--unique` tokens of its own, `--output-len` tokens out (ignore_eos); closed-loop clients at each
concurrency, caching on and off in the same run: throughput and TTFT.
Workload B (memory pressure): unrelated prompts at the highest concurrency with a KV pool that
holds about half the sequences at full length, preemption by recompute vs by swap: throughput
and TPOT p95.
Prints markdown tables; with --write-doc rewrites the prefix-bench block of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import statistics
import time

import torch

from scripts.doc_blocks import rewrite_block

BEGIN, END = "<!-- prefix-bench:begin -->", "<!-- prefix-bench:end -->"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def run_clients(engine, prompts, output_len: int, concurrency: int) -> dict:
    """Closed loop: `concurrency` clients, each sending its next prompt when the last one finished."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    queue = list(enumerate(prompts))
    ttfts, tpots = [], []
    generated = 0

    async def client():
        nonlocal generated
        while queue:
            index, prompt = queue.pop(0)
            sent = time.perf_counter()
            first = None
            tokens = 0
            async for delta in engine.generate(prompt, params, request_id=f"r{index}-{sent}"):
                tokens += len(delta.outputs[0].token_ids)
                if first is None and tokens:
                    first = time.perf_counter()
            done = time.perf_counter()
            ttfts.append(first - sent)
            tpots.append((done - first) / max(1, tokens - 1))
            generated += tokens

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return {
        "tok_s": generated / wall,
        "ttft_mean": statistics.mean(ttfts),
        "ttft_p95": percentile(ttfts, 95),
        "tpot_p95": percentile(tpots, 95),
        "wall": wall,
    }


def measure(model_dir: str, dtype: str, prompts, output_len: int, concurrency: int, **engine_args) -> dict:
    from engine.async_engine import AsyncLLMEngine
    from engine.config import EngineConfig

    max_model_len = max(map(len, prompts)) + output_len
    engine = AsyncLLMEngine(EngineConfig(model=model_dir, dtype=dtype, max_model_len=max_model_len, **engine_args))
    try:
        result = asyncio.run(run_clients(engine, prompts, output_len, concurrency))
        stats = engine.stats()
        result["preemptions"] = dict(stats.num_preemptions_by_mode)
        result["hit_rate"] = stats.prefix_cache_hits / max(1, stats.prefix_cache_queries)
        result["peak_blocks"] = engine.engine.scheduler.block_manager.peak_num_used_blocks
        return result
    finally:
        engine.shutdown()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory (default: the random-weight bench-shaped model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shared", type=int, default=400)
    parser.add_argument("--unique", type=int, default=112)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", default="10,50")
    parser.add_argument("--num-prompts", default="20,50", help="per concurrency level")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the engine's token budget per step")
    parser.add_argument("--skip-pressure", action="store_true")
    parser.add_argument("--write-doc", action="store_true")
    args = parser.parse_args(argv)

    from engine.checkpoint.random_model import ensure_bench_model
    from scripts.bench_engine import cpu_name

    model_dir = args.model or str(ensure_bench_model())
    rng = random.Random(0)
    vocab = 32000
    levels = [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.num_prompts.split(",")]
    prefix = [rng.randrange(3, vocab) for _ in range(args.shared)]
    lines = [
        f"Machine: {cpu_name()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}; "
        f"date {datetime.date.today().isoformat()}; bench model, {args.dtype}, block size {args.block_size}, "
        f"max_num_batched_tokens {args.max_num_batched_tokens}.",
        "",
        f"Shared prefix: {args.shared} shared + {args.unique} unique prompt tokens, {args.output_len} output "
        "tokens (ignore_eos), closed-loop clients.",
        "",
        "| concurrency | prompts | caching | tok/s | TTFT mean s | TTFT p95 s | peak KV blocks | hit rate | "
        "throughput on/off | TTFT mean on/off |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for concurrency, num in zip(levels, counts):
        prompts = [prefix + [rng.randrange(3, vocab) for _ in range(args.unique)] for _ in range(num)]
        runs = {}
        for caching in (False, True):
            runs[caching] = measure(model_dir, args.dtype, prompts, args.output_len, concurrency,
                                    enable_prefix_caching=caching, block_size=args.block_size,
                                    max_num_batched_tokens=args.max_num_batched_tokens)
            print(concurrency, "caching" if caching else "no caching", runs[caching], flush=True)
        off, on = runs[False], runs[True]
        for caching, r in ((False, off), (True, on)):
            ratio = (f"{on['tok_s'] / off['tok_s']:.2f}× | {on['ttft_mean'] / off['ttft_mean']:.2f}×"
                     if caching else "|")
            lines.append(
                f"| {concurrency} | {num} | {'on' if caching else 'off'} | {r['tok_s']:.0f} | {r['ttft_mean']:.2f} | "
                f"{r['ttft_p95']:.2f} | {r['peak_blocks']} | {r['hit_rate']:.0%} | {ratio} |"
            )

    if not args.skip_pressure:
        concurrency, num = levels[-1], counts[-1]
        prompt_len = args.shared + args.unique
        prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(num)]
        per_seq = -(-(prompt_len + args.output_len) // args.block_size)
        num_blocks = per_seq * concurrency // 2
        lines += [
            "",
            f"Memory pressure: {num} unrelated prompts of {prompt_len} tokens, {args.output_len} output tokens, "
            f"concurrency {concurrency}, KV pool of {num_blocks} blocks (half of the {concurrency} sequences at "
            "full length), prefix caching off.",
            "",
            "| preemption | tok/s | TPOT p95 ms | TTFT mean s | preemptions (recompute / swap) |",
            "|---|---|---|---|---|",
        ]
        for mode in ("recompute", "swap"):
            r = measure(model_dir, args.dtype, prompts, args.output_len, concurrency, preemption_mode=mode,
                        num_kv_blocks=num_blocks, enable_prefix_caching=False, block_size=args.block_size,
                        swap_space=1.0, max_num_batched_tokens=args.max_num_batched_tokens)
            print("pressure", mode, r, flush=True)
            lines.append(
                f"| {mode} | {r['tok_s']:.0f} | {r['tpot_p95'] * 1e3:.0f} | {r['ttft_mean']:.2f} | "
                f"{r['preemptions']['recompute']} / {r['preemptions']['swap']} |"
            )
    command = "python -m scripts.bench_prefix " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    lines += ["", f"Command: `{command.strip()}`"]
    table = "\n".join(lines)
    print(table)
    if args.write_doc:
        rewrite_block(BEGIN, END, table, "Prefix caching and swap")


if __name__ == "__main__":
    main()
