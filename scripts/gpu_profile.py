"""The second GPU run: what scripts/gpu_check.py's first run left open, measured in one short call.

    python scripts/gpu_profile.py --dry-run              # here, on CPU: the plumbing (tests/kernels runs it)
    python3 scripts/gpu_profile.py --wheels .whl --out $OUT   # on the GPU machine

1. Prefill attention's launch settings: (BLOCK_M, BLOCK_N, num_warps, num_stages) swept at 4 prompts x 2,048
   tokens (Llama-3-8B's heads), each checked against the torch reference first, timed against SDPA. The first
   run had the default (64, 64, 8, 2) at 2.72x SDPA's time.
2. Where a decode step's time goes: a TP=1 engine on a random bench-shape Llama in bfloat16, batch 32, under
   torch.profiler: wall time a step, the device's busy time a step, kernel launches a step, and the host ops
   that cost the most. The first run's demo-model decode was 12.8 ms a step at 32 GB/s: the host, not HBM.
3. The sampler's rows by kind at vocab 151,936: greedy, plain, top-k + top-p, top-p + min-p, each alone,
   since 8 mixed rows took 2.9 ms against 0.07 ms for one greedy row.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.gpu_check import Report, install_wheels  # noqa: E402


def prefill_sweep(target, report, iters: int) -> None:

    from kernels import backend as kernel_backend
    from kernels.prefill_attention_triton import paged_prefill_attention_triton
    from scripts.gpu_check_kernels import HEAD_DIM, check_close, paged_scene, prefill_timing_scenes

    batch, seq_len = (4, 2048) if target.on_gpu else (1, 64)
    dtype, dev = target.dtype, target.device
    small = paged_scene(2, 300 if target.on_gpu else 40, dtype, dev, 77 if target.on_gpu else 9)
    small_f32 = [x.float() if x.is_floating_point() else x for x in small]
    ref = kernel_backend.TORCH.paged_prefill_attention(small_f32[0].cpu(), small_f32[1].cpu(), small[2].cpu(),
                                                       small[4].cpu(), small[3].cpu(), HEAD_DIM**-0.5)
    sets, flops, sdpa_ms = prefill_timing_scenes(target, batch, seq_len, iters)
    report.row(f"prefill SDPA b{batch}x{seq_len}", f"{sdpa_ms:.3f} ms", f"{flops / sdpa_ms / 1e9:.0f} TFLOP/s")
    if target.on_gpu:
        configs = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)))
    else:
        configs = [(16, 32, 4, 2)]
    results = []
    for config in configs:
        with report.step(f"prefill {config}"):
            query, kv_cache, tables, lens, qsl = small
            got = paged_prefill_attention_triton(query, kv_cache, tables, qsl, lens, HEAD_DIM**-0.5,
                                                 max_query_len=query.shape[0] // 2, config=config)
            check_close(f"prefill {config}", got.cpu(), ref, dtype)
            ms = target.time_ms(lambda q, kv, t, ln, s, config=config: paged_prefill_attention_triton(
                q, kv, t, s, ln, HEAD_DIM**-0.5, max_query_len=seq_len, config=config), sets, iters)
            results.append((ms, config))
    for ms, config in sorted(results)[:8]:
        report.row(f"prefill (BLOCK_M, BLOCK_N, warps, stages) = {config}", f"{ms:.3f} ms",
                   f"{flops / ms / 1e9:.0f} TFLOP/s", f"{ms / sdpa_ms:.2f}x SDPA's time")


def decode_profile(target, report) -> None:
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams
    from engine.checkpoint.random_model import make_model
    from scripts.gpu_check_engine import make_llm, release

    shape = "bench" if target.on_gpu else "tiny"
    model = make_model("llama", shape, Path(tempfile.mkdtemp(prefix="gpu-profile-")))
    llm = make_llm(target, str(model))  # gpu_check's engine settings
    engine = llm.engine
    batch, steps = (32, 40) if target.on_gpu else (4, 4)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 30, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p-{i}", [(7 * i + j) % 900 + 3 for j in range(128)], params)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(10):  # warm
        engine.step()
    sync = torch.cuda.synchronize if target.on_gpu else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    plain_ms = (time.perf_counter() - start) / steps * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if target.on_gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    events = prof.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", 0) for e in events) / steps
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                        "cudaLaunchKernelExC")) / steps
    report.row(f"decode step, {shape}-shape Llama {target.dtype}, batch {batch}", f"{plain_ms:.2f} ms a step",
               f"device busy {device_us / 1e3:.2f} ms a step", f"{launches:.0f} launches a step")
    for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:14]:
        report.row(f"host: {e.key[:60]}", f"{e.self_cpu_time_total / steps / 1e3:.3f} ms a step", f"x{e.count / steps:.1f}")
    if target.on_gpu:
        for e in sorted(events, key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)[:8]:
            report.row(f"device: {e.key[:60]}", f"{e.self_device_time_total / steps / 1e3:.3f} ms a step",
                       f"x{e.count / steps:.1f}")
    release(llm)


def sampler_kinds(target, report, iters: int) -> None:
    import torch

    from scripts.gpu_check_kernels import QWEN_VOCAB, sampler_inputs

    rows = 8 if target.on_gpu else 2
    vocab = QWEN_VOCAB if target.on_gpu else 512
    mixed = sampler_inputs(4 * rows, vocab, target.device)
    for kind in range(4):  # sampler_inputs cycles the kinds row by row
        pick = torch.arange(kind, 4 * rows, 4, device=target.device)
        inputs = [x[pick] if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == 4 * rows else x
                  for x in mixed]
        with report.step(f"sample_tokens kind {kind}"):
            ms = target.time_ms(target.ops.sample_tokens, [inputs], iters)
            report.row(f"sample_tokens {rows} rows of kind {kind} (greedy, plain, top-k+top-p, top-p+min-p)",
                       f"{ms:.3f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--wheels", type=Path)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args(argv)
    if args.dry_run:  # before triton is imported: the sweep runs the kernel in Triton's interpreter
        os.environ["TRITON_INTERPRET"] = "1"
    if args.wheels:
        install_wheels(args.wheels)
    from scripts.gpu_check_kernels import Target

    if args.dry_run:  # the references time the sampler and run the engine
        target = Target.cpu_rehearsal()
    else:
        target = Target.cuda()
    report = Report()
    report.row(*target.describe())
    with report.step("sampler kinds"):
        sampler_kinds(target, report, args.iters)
    with report.step("prefill sweep"):
        prefill_sweep(target, report, args.iters)
    with report.step("decode profile"):
        decode_profile(target, report)
    report.write(args.out)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
