"""Offline engine benchmark (the engine half of `make bench`).

Workload (issue: engine core): 64 prompts of 512 random token ids, 128 output tokens each,
ignore_eos, on the `bench` model, in bfloat16 and float32, greedy and sampled at temperature 1.0
(what vLLM's client gets by default). Beside it, in the same run:
  (a) Hugging Face `generate` on the same prompts in static batches of 8;
  (b) the limit: the same model's forward pass alone, as batched decode steps (batch 64,
      KV growing 512 -> 640) and as 512-token prefills, giving the best tokens/s possible.
Prints a markdown table and, with --write-doc, rewrites the engine block of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import random
import statistics
import subprocess
import time

import torch

from scripts.doc_blocks import rewrite_block

BEGIN, END = "<!-- engine-bench:begin -->", "<!-- engine-bench:end -->"


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def make_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(num)]


def timed_generate(llm, prompts, output_len: int, temperature: float) -> float:
    """Generated tokens per second of one offline batch."""
    from engine import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == len(prompts) * output_len
    return generated / elapsed


def bench_engine(model_dir: str, dtype: str, prompts, output_len: int) -> dict:
    """Greedy on `prompts`, then sampled on a second set of the same shape: prefix caching is off (as
    for vLLM in scripts/bench_peer.py), so no run reuses another's prefill."""
    from engine import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, max_model_len=1024, enable_prefix_caching=False)
    llm.generate(prompts[:2], SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))  # warm-up
    greedy = timed_generate(llm, prompts, output_len, 0.0)
    second = make_prompts(len(prompts), len(prompts[0]), 32000, seed=1)
    sampled = timed_generate(llm, second, output_len, 1.0)
    # the prompts alone (one output token each): prefill steps at the engine's full token budget
    third = make_prompts(len(prompts), len(prompts[0]), 32000, seed=2)
    start = time.perf_counter()
    llm.generate(third, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    prefill_s = time.perf_counter() - start
    return {"tok_s": greedy, "sampled_tok_s": sampled, "prefill_s": prefill_s, "llm": llm}


def bench_limit(llm, num_seqs: int, prompt_len: int, output_len: int, repeats: int = 3) -> dict:
    """Time the engine's own forward pass with no scheduling, sampling or detokenization."""
    from engine.config import SamplingParams
    from engine.model_runner import prepare_step
    from engine.scheduler import ScheduledChunk, SchedulerOutput
    from engine.sequence import Request

    engine = llm.engine
    runner = engine.executor
    block_size = engine.config.block_size
    total_len = prompt_len + output_len
    blocks_per_seq = -(-total_len // block_size)
    assert blocks_per_seq * num_seqs <= runner.num_blocks, "KV cache too small for the limit measurement"
    seqs = []
    for i in range(num_seqs):
        seq = Request(f"limit-{i}", None, [5] * total_len, SamplingParams()).seqs[0]
        seq.block_table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        seqs.append(seq)

    def timed(sched: SchedulerOutput) -> float:
        step = prepare_step(sched, block_size)
        runner.execute_model(step, None)  # warm-up: the forward pass alone, nothing sampled
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.execute_model(step, None)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    # Prefill: one prompt alone, and as many prompts as one step of the engine's token budget
    # holds (what the engine does); the cheaper per-prompt time is the limit.
    prompts_per_step = max(1, min(num_seqs, engine.config.max_num_batched_tokens // prompt_len))
    for seq in seqs:
        seq.num_computed_tokens = 0
    prefill_one = timed(SchedulerOutput(prefills=[ScheduledChunk(seqs[0], prompt_len)]))
    prefill_batched = timed(
        SchedulerOutput(prefills=[ScheduledChunk(s, prompt_len) for s in seqs[:prompts_per_step]])
    ) / prompts_per_step
    prefill = min(prefill_one, prefill_batched)
    decode_times = []
    for kv in (prompt_len, prompt_len + output_len // 2, total_len - 1):
        for seq in seqs:
            seq.num_computed_tokens = kv - 1
            del seq.token_ids[kv:]
        decode_times.append(timed(SchedulerOutput(decodes=[ScheduledChunk(s, 1) for s in seqs])))
        for seq in seqs:
            seq.token_ids.extend([5] * (total_len - len(seq.token_ids)))
    decode = statistics.mean(decode_times)
    best_seconds = num_seqs * prefill + output_len * decode
    return {
        "prefill_one_s": prefill_one,
        "prefill_batched_s": prefill_batched,
        "prompts_per_step": prompts_per_step,
        "prefill_512_s": prefill,
        "decode_step_s": decode,
        "seconds": best_seconds,
        "tok_s": num_seqs * output_len / best_seconds,
    }


def bench_hf(model_dir: str, dtype: str, prompts, output_len: int, batch: int = 8) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    kwargs = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor(prompts[:1]), max_new_tokens=2, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        generated = 0
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i : i + batch])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            generated += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "tok_s": generated / elapsed}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF directory (default: the random-weight bench-shaped model)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--write-doc", action="store_true")
    args = parser.parse_args(argv)

    from engine.checkpoint.random_model import ensure_bench_model

    model_dir = args.model or str(ensure_bench_model())
    vocab = 32000
    prompts = make_prompts(args.num_prompts, args.prompt_len, vocab)
    rows = []
    for dtype in args.dtypes.split(","):
        engine = bench_engine(model_dir, dtype, prompts, args.output_len)
        limit = bench_limit(engine.pop("llm"), args.num_prompts, args.prompt_len, args.output_len)
        hf = None if args.skip_hf else bench_hf(model_dir, dtype, prompts, args.output_len)
        rows.append((dtype, engine, limit, hf))
        print(f"{dtype}: engine {engine['tok_s']:.0f} tok/s greedy, {engine['sampled_tok_s']:.0f} sampled, limit {limit['tok_s']:.0f} tok/s"
              + ("" if hf is None else f", HF {hf['tok_s']:.0f} tok/s"), flush=True)

    lines = [
        f"Machine: {cpu_name()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}; "
        f"date {datetime.date.today().isoformat()}. Workload: {args.num_prompts} prompts × {args.prompt_len} "
        f"random token ids → {args.output_len} tokens each (ignore_eos), bench model.",
        "",
        "| dtype | engine tok/s greedy | engine tok/s at T=1.0 | HF generate (batch 8, greedy) tok/s | "
        "limit tok/s | engine/HF | engine/limit | prefill per prompt: alone / batched ms | decode step (batch 64) ms | "
        f"engine, the {args.num_prompts} prompts alone (→ 1 token) s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dtype, engine, limit, hf in rows:
        hf_tok = f"{hf['tok_s']:.0f}" if hf else "—"
        ratio_hf = f"{engine['tok_s'] / hf['tok_s']:.2f}×" if hf else "—"
        lines.append(
            f"| {dtype} | {engine['tok_s']:.0f} | {engine['sampled_tok_s']:.0f} | {hf_tok} | {limit['tok_s']:.0f} | {ratio_hf} | "
            f"{engine['tok_s'] / limit['tok_s']:.2f} | {limit['prefill_one_s'] * 1e3:.1f} / "
            f"{limit['prefill_batched_s'] * 1e3:.1f} ({limit['prompts_per_step']} per step) | "
            f"{limit['decode_step_s'] * 1e3:.1f} | {engine['prefill_s']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.write_doc:
        command = "make bench  (python -m scripts.bench_engine --write-doc)"
        rewrite_block(BEGIN, END, f"{table}\n\nCommand: `{command}`", "Engine (offline)")


if __name__ == "__main__":
    main()
