"""Where a CPU decode step goes: attention vs matmuls vs the rest, from torch.profiler, torch kernels.

    python scripts/profile_cpu_step.py [--batch 64] [--context 512] [--threads 2] [--steps 3]

Builds (or reuses) the random-weight bench-shaped model, brings `batch` sequences of `context` prompt tokens
into decode on the torch reference kernels, then profiles `steps` whole engine steps (scheduler,
model, sampler). Each kernel-package op is labelled with record_function; "matmuls" are the model's
aten::linear calls (projections, MLP, LM head). Prints a markdown table of shares of the step.

Besides the profiler's wall-clock times, each part's CPU time (time.thread_time around it) is summed:
with --threads 1 that is what the part costs even when other processes share the cores, which makes
the shares comparable between runs on a busy machine.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from kernels import backend as kernel_backend  # noqa: E402

OPS = [
    "write_kv_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]


CPU_SECONDS: dict[str, float] = {}  # part -> thread CPU seconds spent in it while profiling


def labelled(name: str, fn):
    def run(*args, **kwargs):
        with record_function(f"kernel::{name}"):
            start = time.thread_time()
            result = fn(*args, **kwargs)
            CPU_SECONDS[name] = CPU_SECONDS.get(name, 0.0) + time.thread_time() - start
            return result

    return run


def row(label: str, wall: float, cpu: float, step_wall: float, step_cpu: float, steps: int) -> str:
    return f"| {label} | {wall / steps * 1e3:.1f} | {wall / step_wall:.0%} | {cpu / steps * 1e3:.1f} | {cpu / step_cpu:.0%} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", type=Path, help="model directory (default: the random-weight bench model)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from engine.checkpoint.random_model import ensure_bench_model
    from engine.config import EngineConfig, SamplingParams
    from engine.llm_engine import LLMEngine

    torch_ops = kernel_backend.TORCH
    kernel_backend.TORCH = kernel_backend.KernelBackend(
        name="torch",
        **{
            f.name: labelled(f.name, getattr(torch_ops, f.name))
            for f in fields(torch_ops)
            if f.name != "name"
        },
    )
    F.linear = labelled("linear", F.linear)  # the model's matmuls all go through F.linear
    model_dir = args.model or ensure_bench_model()
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="bfloat16",
            device="cpu",
            kernel_backend="torch",
            max_num_seqs=args.batch,
        )
    )
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), [rng.randrange(3, 32000) for _ in range(args.context)], params)
    started = time.perf_counter()
    while engine.scheduler.waiting or any(
        seq.num_computed_tokens < args.context for seq in engine.scheduler.running
    ):
        engine.step()
    print(
        f"prefill of {args.batch} x {args.context} tokens: {time.perf_counter() - started:.1f} s",
        file=sys.stderr,
    )
    engine.step()  # one plain decode step outside the profile (warm-up)

    CPU_SECONDS.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            with record_function("engine_step"):
                start = time.thread_time()
                engine.step()
                CPU_SECONDS["step"] = CPU_SECONDS.get("step", 0.0) + time.thread_time() - start
    wall = {event.key.removeprefix("kernel::"): event.cpu_time_total / 1e6 for event in prof.key_averages()}
    wall["step"] = wall["engine_step"]
    parts = [(name.replace("_", " "), name) for name in OPS]
    parts.append(("matmuls (F.linear: QKV, O, gate/up, down, LM head)", "linear"))
    print(
        f"Decode step, batch {args.batch}, KV {args.context}, {args.threads} thread(s), mean of {args.steps} steps:"
    )
    print()
    print("| part of the step | wall ms (profiler) | wall share | CPU ms (thread time) | CPU share |")
    print("| --- | --- | --- | --- | --- |")
    for label, key in parts:
        if key in CPU_SECONDS:
            print(
                row(
                    label, wall.get(key, 0.0), CPU_SECONDS[key], wall["step"], CPU_SECONDS["step"], args.steps
                )
            )
    rest_wall = wall["step"] - sum(wall.get(key, 0.0) for _, key in parts)
    rest_cpu = CPU_SECONDS["step"] - sum(CPU_SECONDS.get(key, 0.0) for _, key in parts)
    rest = "everything else (embedding, sampler, scheduler, metadata)"
    print(row(rest, rest_wall, rest_cpu, wall["step"], CPU_SECONDS["step"], args.steps))
    print(
        row(
            "whole engine step",
            wall["step"],
            CPU_SECONDS["step"],
            wall["step"],
            CPU_SECONDS["step"],
            args.steps,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
