"""scripts/gpu_check.py's kernel steps: each Triton kernel against its torch reference, the HBM copy rate,
decode and prefill attention timings, and the sampler and grammar mask at vocab 151,936.

Timings on CUDA are CUDA-event medians over many calls after a warm-up, rotating through enough input sets
that they do not sit in L2; on the CPU rehearsal (--dry-run) they are wall-clock medians of a few calls
with the torch references standing in for Triton, which checks the plumbing, not the figures.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from dataclasses import dataclass

import torch

from kernels import backend as kernel_backend
from kernels.bitmask import bitmask_words
from kernels.rotary import rope_cos_sin_cache
from kernels.sampling import counter_uniforms

# Llama-3-8B-like attention at TP=1: 32 query heads over 8 KV heads, head_dim 128, blocks of 16.
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
QWEN_VOCAB = 151936  # Qwen2.5's vocabulary: the widest row the sampler and the mask see


class Mismatch(AssertionError):
    """A kernel disagrees with its torch reference."""


@dataclass(frozen=True)
class Target:
    """Where the check runs: CUDA with the Triton kernels, or the CPU rehearsal with the references."""

    device: str
    ops: kernel_backend.KernelBackend  # the kernels under test
    engine_backend: str  # EngineConfig.kernel_backend of the engine steps
    dtype: torch.dtype  # the engine's and the timed kernels' dtype
    scale: int  # 1 on CUDA; larger shrinks the rehearsal's sizes

    @classmethod
    def cuda(cls) -> Target:
        return cls("cuda", kernel_backend.get_backend("triton", "cuda"), "triton", torch.bfloat16, 1)

    @classmethod
    def cpu_rehearsal(cls) -> Target:
        return cls("cpu", kernel_backend.TORCH, "torch", torch.float32, 16)

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    def describe(self) -> list[str]:
        import triton

        if self.on_gpu:
            props = torch.cuda.get_device_properties(0)
            where = f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB"
        else:
            where = "CPU rehearsal (--dry-run): torch references, not figures"
        return [f"device: {where}", f"torch {torch.__version__}", f"triton {triton.__version__}",
                time.strftime("%Y-%m-%d")]

    def time_ms(self, fn, arg_sets: list, iters: int) -> float:
        """Median milliseconds of fn(*args): CUDA events on the GPU, wall clock on the CPU."""
        if not self.on_gpu:  # the rehearsal times one call: it checks that the timing runs, not what it says
            start = time.perf_counter()
            fn(*arg_sets[0])
            return (time.perf_counter() - start) * 1e3
        for i in range(5):
            fn(*arg_sets[i % len(arg_sets)])
        torch.cuda.synchronize()
        events = []
        for i in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*arg_sets[i % len(arg_sets)])
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)

    def rotations(self, make, set_bytes: int) -> list:
        """Enough independent input sets that one pass over them is three times the L2 cache."""
        if not self.on_gpu:
            return [make()]
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
        return [make() for _ in range(max(2, min(8, math.ceil(3 * l2 / max(set_bytes, 1)))))]


def paged_scene(batch: int, context_len: int, dtype, device, query_len: int = 1):
    """A KV cache holding `batch` sequences of `context_len` tokens in shuffled blocks, and their queries."""
    blocks_per_seq = math.ceil(context_len / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    kv_cache = torch.randn(2, KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM, device=device, dtype=dtype)
    block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    context_lens = torch.full((batch,), context_len, dtype=torch.int32, device=device)
    query = torch.randn(batch * query_len, HEADS, HEAD_DIM, device=device, dtype=dtype)
    query_start_loc = torch.arange(0, batch * query_len + 1, query_len, dtype=torch.int32, device=device)
    return query, kv_cache, block_tables, context_lens, query_start_loc


def check_close(name: str, got: torch.Tensor, want: torch.Tensor, dtype) -> float:
    """Relative error of an output against the reference computed in float32."""
    if got.isnan().any():
        raise Mismatch(f"{name}: NaN in the output")
    error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    bound = 1e-4 if dtype == torch.float32 else 2e-2
    if error > bound:
        raise Mismatch(f"{name}: relative error {error:.2e} > {bound:.0e}")
    return error


def kernel_steps(target: Target, report) -> None:
    """Every op in float32 and bfloat16 on odd shapes, each against the torch reference run in float32."""
    ref, ops, dev = kernel_backend.TORCH, target.ops, target.device
    scenes = ((7, 333, 1), (3, 1000, 1), (2, 5000, 1), (5, 300, 77)) if target.on_gpu else ((3, 333, 1), (2, 100, 17))
    for dtype in (torch.float32, torch.bfloat16):
        tag = str(dtype).removeprefix("torch.")
        for batch, ctx, qlen in scenes:
            kind = "decode" if qlen == 1 else "prefill"
            name = f"{kind} b{batch} ctx{ctx}" + (f" chunk{qlen}" if qlen > 1 else "") + f" {tag}"
            with report.step(name):
                query, kv_cache, tables, lens, qsl = paged_scene(batch, ctx, dtype, dev, qlen)
                lens = lens - torch.arange(batch, device=dev, dtype=torch.int32)  # ragged, off the block grid
                f32 = (query.float(), kv_cache.float())
                if qlen == 1:
                    got = ops.paged_decode_attention(query, kv_cache, tables, lens, HEAD_DIM**-0.5)
                    want = ref.paged_decode_attention(*f32, tables, lens, HEAD_DIM**-0.5)
                else:
                    got = ops.paged_prefill_attention(query, kv_cache, tables, qsl, lens, HEAD_DIM**-0.5)
                    want = ref.paged_prefill_attention(*f32, tables, qsl, lens, HEAD_DIM**-0.5)
                report.row(name, f"{check_close(name, got, want, dtype):.1e}")
        tokens, hidden = 37, 4096
        with report.step(f"rms_norm+residual {tag}"):
            x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
            residual, weight = torch.randn_like(x), torch.randn(hidden, device=dev, dtype=dtype)
            got, got_sum = ops.rms_norm(x, weight, 1e-5, residual=residual)
            want, want_sum = ref.rms_norm(x, weight, 1e-5, residual=residual)
            error = max(check_close("rms_norm", got, want, dtype), check_close("sum", got_sum, want_sum, dtype))
            report.row(f"rms_norm+residual {tag}", f"{error:.1e}")
        with report.step(f"rotary {tag}"):
            cos_sin = rope_cos_sin_cache(HEAD_DIM, 8192, 500000.0).to(dev)
            positions = torch.randint(0, 8192, (tokens,), device=dev)
            q = torch.randn(tokens, HEADS, HEAD_DIM, device=dev, dtype=dtype)
            k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=dev, dtype=dtype)
            (gq, gk), (wq, wk) = ops.rotary_embedding(positions, q, k, cos_sin), ref.rotary_embedding(
                positions, q.float(), k.float(), cos_sin)
            report.row(f"rotary {tag}", f"{max(check_close('q', gq, wq, dtype), check_close('k', gk, wk, dtype)):.1e}")
        with report.step(f"silu_and_mul {tag}"):
            gate_up = torch.randn(tokens, 2 * 14336, device=dev, dtype=dtype)
            error = check_close("silu", ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up.float()), dtype)
            report.row(f"silu_and_mul {tag}", f"{error:.1e}")
        with report.step(f"write_kv_cache {tag}"):
            _, kv_cache, *_ = paged_scene(4, 100, dtype, dev)
            cache_a, cache_b = torch.zeros_like(kv_cache), torch.zeros_like(kv_cache)
            slots = torch.randperm(kv_cache.shape[2] * BLOCK_SIZE, device=dev)[:tokens]
            slots[::5] = -1
            new_k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=dev, dtype=dtype)
            new_v = torch.randn_like(new_k)
            ops.write_kv_cache(new_k, new_v, cache_a, slots)
            ref.write_kv_cache(new_k, new_v, cache_b, slots)
            if not torch.equal(cache_a, cache_b):
                raise Mismatch(f"write_kv_cache {tag}: caches differ")
            report.row(f"write_kv_cache {tag}", "exact")


def speed_steps(target: Target, report, iters: int) -> None:
    """The copy rate, then decode attention as bytes read per second against it, then prefill against SDPA."""
    with report.step("device-to-device copy"):
        copy_rate(target, report, iters)
    copy_gbs = report.facts.get("copy_gbs", float("nan"))
    shrink = target.scale
    for batch, ctx, splits in ((64, 2048, None), (4, 32768, None), (4, 32768, 1)):
        batch, ctx = max(1, batch // shrink), ctx // (4 * shrink) if shrink > 1 else ctx
        with report.step(f"decode b{batch}x{ctx}" + (" one partition" if splits else "")):
            time_decode(target, batch, ctx, iters, copy_gbs, report, splits)
    with report.step("prefill"):
        time_prefill(target, max(1, 4 // shrink), 2048 // shrink, iters, report)


def copy_rate(target: Target, report, iters: int) -> None:
    """Device-to-device copy of 2 GiB: (read + write) bytes per second, the practical memory ceiling."""
    size = (2 << 30) if target.on_gpu else (64 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=target.device)
    dst = torch.empty_like(src)
    ms = target.time_ms(lambda: dst.copy_(src), [()], iters)
    report.facts["copy_gbs"] = copy_gbs = 2 * size / ms / 1e6
    report.row(f"device-to-device copy ({size >> 20} MiB)", f"{ms:.3f} ms", f"{copy_gbs:.0f} GB/s", "100% of copy")


def time_decode(target: Target, batch: int, ctx: int, iters: int, copy_gbs: float, report, splits=None) -> None:
    """Decode attention's K/V bytes read per second, the kernel (with forced partitions) and the reference."""
    dtype = target.dtype
    kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * dtype.itemsize
    sets = target.rotations(lambda: paged_scene(batch, ctx, dtype, target.device)[:4], kv_bytes)
    kernel = target.ops.paged_decode_attention
    if splits is not None and target.on_gpu:
        kernel = functools.partial(kernel, num_splits=splits)
    runs = [("kernel", kernel)] + ([("torch ref", kernel_backend.TORCH.paged_decode_attention)]
                                   if splits is None and target.on_gpu else [])
    for name, decode in runs:
        ms = target.time_ms(lambda q, kv, t, lens, decode=decode: decode(q, kv, t, lens, HEAD_DIM**-0.5), sets, iters)
        gbs = kv_bytes / ms / 1e6
        label = f"decode {name} b{batch}x{ctx}" + (f" splits={splits}" if splits else "")
        report.row(label, f"{ms:.3f} ms", f"{gbs:.0f} GB/s", f"{gbs / copy_gbs:.0%} of copy")


def prefill_timing_scenes(target: Target, batch: int, seq_len: int, iters: int) -> tuple[list, int, float]:
    """Whole prompts of `seq_len` in the paged cache (input sets that rotate out of L2), their attention's
    flops, and SDPA's milliseconds on the same dense causal shapes: what a prefill kernel is timed against."""
    dtype, dev = target.dtype, target.device
    flops = 2 * batch * HEADS * HEAD_DIM * seq_len * seq_len  # QK^T and PV, 2 flops a MAC, half of it causal
    sets = target.rotations(lambda: paged_scene(batch, seq_len, dtype, dev, seq_len),
                            3 * batch * seq_len * HEADS * HEAD_DIM * dtype.itemsize)

    def sdpa(query, key, value):
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)

    dense = [tuple(torch.randn(batch, h, seq_len, HEAD_DIM, device=dev, dtype=dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
             for _ in sets]
    return sets, flops, target.time_ms(sdpa, dense, iters)


def time_prefill(target: Target, batch: int, seq_len: int, iters: int, report) -> None:
    """Whole-prompt prefill over the paged cache against SDPA on the same dense causal shapes."""
    sets, flops, sdpa_ms = prefill_timing_scenes(target, batch, seq_len, iters)

    def paged(query, kv_cache, block_tables, context_lens, query_start_loc):
        return target.ops.paged_prefill_attention(query, kv_cache, block_tables, query_start_loc, context_lens,
                                                  HEAD_DIM**-0.5, max_query_len=seq_len)

    ms = target.time_ms(paged, sets, iters)
    label = f"b{batch}x{seq_len}"
    report.row(f"prefill kernel {label}", f"{ms:.3f} ms", f"{flops / ms / 1e9:.0f} TFLOP/s", f"{ms / sdpa_ms:.2f}x SDPA's time")
    report.row(f"prefill SDPA {label}", f"{sdpa_ms:.3f} ms", f"{flops / sdpa_ms / 1e9:.0f} TFLOP/s", "")


def sampler_inputs(rows: int, vocab: int, device: str):
    """Logits and a mix of the four sampling kinds: greedy, plain, top-k + top-p, top-p + min-p."""
    logits = 2 * torch.randn(rows, vocab, device=device)
    params = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 50, 0.9, 0.0), (1.0, 0, 0.95, 0.05)]
    temperature, top_k, top_p, min_p = (
        torch.tensor([params[r % 4][i] for r in range(rows)], dtype=dt, device=device)
        for i, dt in enumerate((torch.float32, torch.int32, torch.float32, torch.float32))
    )
    uniforms = counter_uniforms(list(range(rows)), [0] * rows).to(device)
    return logits, temperature, top_k, top_p, min_p, uniforms


def sampler_steps(target: Target, report, iters: int) -> None:
    """The fused sampler and the grammar mask at vocab 151,936: the reference's draws, then their times."""
    vocab, dev = QWEN_VOCAB, target.device
    for rows in (1, 8, 64) if target.on_gpu else (8,):
        with report.step(f"sample_tokens {rows} x {vocab}"):
            inputs = sampler_inputs(rows, vocab, dev)
            got = target.ops.sample_tokens(*inputs).cpu()
            want = kernel_backend.TORCH.sample_tokens(*(x.cpu() for x in inputs))
            # a draw within rounding of a boundary between two tokens may differ: a handful of rows may
            agree = float((got == want).float().mean())
            if agree < 0.95 and rows >= 8:
                raise Mismatch(f"sample_tokens: {agree:.0%} of rows drew the reference's token")
            ms = target.time_ms(target.ops.sample_tokens, [inputs], iters)
            report.row(f"sample_tokens {rows} x {vocab}", f"{agree:.0%} rows equal", f"{ms:.3f} ms")
    with report.step(f"apply_token_bitmask 64 x {vocab}"):
        logits = torch.randn(64, vocab, device=dev)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (32, bitmask_words(vocab)), dtype=torch.int32, device=dev)
        rows = torch.arange(0, 64, 2, device=dev)
        got, want = logits.clone(), logits.clone().cpu()
        target.ops.apply_token_bitmask(got, bitmask, rows)
        kernel_backend.TORCH.apply_token_bitmask(want, bitmask.cpu(), rows.cpu())
        if not torch.equal(got.cpu(), want):
            raise Mismatch("apply_token_bitmask: the masked logits differ from the reference's")
        ms = target.time_ms(lambda: target.ops.apply_token_bitmask(logits.clone(), bitmask, rows), [()], iters)
        report.row(f"apply_token_bitmask 32 of 64 rows x {vocab}", "exact", f"{ms:.3f} ms (with a clone)")
