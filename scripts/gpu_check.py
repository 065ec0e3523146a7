"""Check every Triton kernel against its torch reference on a CUDA GPU, time them, smoke-test the engine.

    python scripts/gpu_check.py [--out table.md]     # on a CUDA machine; exits non-zero on any mismatch
    python scripts/gpu_check.py --compile-only       # anywhere: compile every kernel for Hopper (sm_90)

Timings are CUDA-event medians over many calls after a warm-up, rotating through enough input sets
that they do not sit in L2. Decode attention is measured as K/V bytes read per second against the
card's device-to-device copy bandwidth; prefill attention as TFLOP/s against PyTorch's
scaled_dot_product_attention on the same (unpaged) shapes.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kernels import backend as kernel_backend  # noqa: E402
from kernels.rotary import rope_cos_sin_cache  # noqa: E402
from kernels.sampling import counter_uniforms  # noqa: E402

DEVICE = "cuda"  # a module constant so that a CPU dry run of the plumbing can point it elsewhere
# Llama-3-8B-like attention at TP=1: 32 query heads over 8 KV heads, head_dim 128, blocks of 16.
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


class Mismatch(AssertionError):
    """A Triton kernel disagrees with its torch reference."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the results table here, as markdown")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per measurement (median)")
    parser.add_argument("--skip-engine", action="store_true", help="skip the engine smoke test")
    parser.add_argument("--compile-only", action="store_true", help="compile every kernel for sm_90; no GPU")
    return parser.parse_args(argv)


# ---------------------------------------------------------------- inputs


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


def rotations(make, set_bytes: int) -> list:
    """Enough independent input sets that one pass over them is three times the L2 cache."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    return [make() for _ in range(max(2, min(8, math.ceil(3 * l2 / max(set_bytes, 1)))))]


def cuda_time_ms(fn, arg_sets: list, iters: int, warmup: int = 5) -> float:
    """Median milliseconds of fn(*args), each call timed alone with CUDA events, inputs rotated."""
    for i in range(warmup):
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


def check_close(name: str, got: torch.Tensor, want: torch.Tensor, dtype) -> float:
    """Relative error of a Triton output against the reference computed in float32."""
    if got.isnan().any():
        raise Mismatch(f"{name}: NaN in the Triton output")
    error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    bound = 1e-4 if dtype == torch.float32 else 2e-2
    if error > bound:
        raise Mismatch(f"{name}: relative error {error:.2e} > {bound:.0e}")
    return error


# ---------------------------------------------------------------- correctness


def check_correctness(triton_ops, rows: list[list[str]]) -> None:
    """Every op, float32 and bfloat16, on odd shapes, against the torch reference run in float32."""
    torch_ops, dev = kernel_backend.TORCH, DEVICE
    for dtype in (torch.float32, torch.bfloat16):
        tag = str(dtype).removeprefix("torch.")
        for batch, ctx, qlen in ((7, 333, 1), (3, 1000, 1), (2, 5000, 1), (5, 300, 77)):
            query, kv_cache, tables, lens, qsl = paged_scene(batch, ctx, dtype, dev, qlen)
            lens = lens - torch.arange(batch, device=dev, dtype=torch.int32)  # ragged, off the block grid
            f32 = (query.float(), kv_cache.float())
            if qlen == 1:
                got = triton_ops.paged_decode_attention(query, kv_cache, tables, lens, HEAD_DIM**-0.5)
                want = torch_ops.paged_decode_attention(*f32, tables, lens, HEAD_DIM**-0.5)
                name = f"decode b{batch} ctx{ctx} {tag}"
            else:
                got = triton_ops.paged_prefill_attention(query, kv_cache, tables, qsl, lens, HEAD_DIM**-0.5)
                want = torch_ops.paged_prefill_attention(*f32, tables, qsl, lens, HEAD_DIM**-0.5)
                name = f"prefill b{batch} chunk{qlen} ctx{ctx} {tag}"
            rows.append([name, f"{check_close(name, got, want, dtype):.1e}"])

        tokens, hidden = 37, 4096
        x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
        residual, weight = torch.randn_like(x), torch.randn(hidden, device=dev, dtype=dtype)
        got, got_sum = triton_ops.rms_norm(x, weight, 1e-5, residual=residual)
        want, want_sum = torch_ops.rms_norm(x, weight, 1e-5, residual=residual)
        error = max(
            check_close(f"rms_norm {tag}", got, want, dtype), check_close("sum", got_sum, want_sum, dtype)
        )
        rows.append([f"rms_norm+residual {tag}", f"{error:.1e}"])

        cos_sin = rope_cos_sin_cache(HEAD_DIM, 8192, 500000.0).to(dev)
        positions = torch.randint(0, 8192, (tokens,), device=dev)
        q, k = (
            torch.randn(tokens, HEADS, HEAD_DIM, device=dev, dtype=dtype),
            torch.randn(tokens, KV_HEADS, HEAD_DIM, device=dev, dtype=dtype),
        )
        (gq, gk), (wq, wk) = (
            triton_ops.rotary_embedding(positions, q, k, cos_sin),
            torch_ops.rotary_embedding(positions, q.float(), k.float(), cos_sin),
        )
        rows.append(
            [
                f"rotary {tag}",
                f"{max(check_close('rotary q', gq, wq, dtype), check_close('rotary k', gk, wk, dtype)):.1e}",
            ]
        )

        gate_up = torch.randn(tokens, 2 * 14336, device=dev, dtype=dtype)
        error = check_close(
            f"silu_and_mul {tag}",
            triton_ops.silu_and_mul(gate_up),
            torch_ops.silu_and_mul(gate_up.float()),
            dtype,
        )
        rows.append([f"silu_and_mul {tag}", f"{error:.1e}"])

        cache_a, cache_b = torch.zeros_like(kv_cache), torch.zeros_like(kv_cache)
        slots = torch.randperm(kv_cache.shape[2] * BLOCK_SIZE, device=dev)[:tokens]
        slots[::5] = -1
        new_k, new_v = (
            torch.randn(tokens, KV_HEADS, HEAD_DIM, device=dev, dtype=dtype),
            torch.randn(tokens, KV_HEADS, HEAD_DIM, device=dev, dtype=dtype),
        )
        triton_ops.write_kv_cache(new_k, new_v, cache_a, slots)
        torch_ops.write_kv_cache(new_k, new_v, cache_b, slots)
        if not torch.equal(cache_a, cache_b):
            raise Mismatch(f"write_kv_cache {tag}: caches differ")
        rows.append([f"write_kv_cache {tag}", "exact"])

    # the sampler: the same draws as the reference (float32 exp on both sides; a draw that lands within
    # rounding of a boundary between two tokens may differ, so a handful of rows may)
    rows_n, vocab = 64, 32000
    logits = 2 * torch.randn(rows_n, vocab, device=dev)
    params = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 50, 0.9, 0.0), (1.0, 0, 0.95, 0.05)]
    temperature, top_k, top_p, min_p = (
        torch.tensor([params[r % 4][i] for r in range(rows_n)], dtype=dt)
        for i, dt in enumerate((torch.float32, torch.int32, torch.float32, torch.float32))
    )
    uniforms = counter_uniforms(list(range(rows_n)), [0] * rows_n)
    got = triton_ops.sample_tokens(logits, temperature, top_k, top_p, min_p, uniforms).cpu()
    want = torch_ops.sample_tokens(logits.cpu(), temperature, top_k, top_p, min_p, uniforms)
    agree = float((got == want).float().mean())
    if agree < 0.95:
        raise Mismatch(f"sample_tokens: {agree:.0%} of rows drew the reference's token")
    rows.append([f"sample_tokens {rows_n} × {vocab}", f"{agree:.0%} rows equal"])


# ---------------------------------------------------------------- speed


def copy_bandwidth_gbs(iters: int) -> float:
    """Device-to-device copy of 2 GiB: (read + write) bytes per second, the practical memory ceiling."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), [()], iters)
    return 2 * src.numel() / ms / 1e6


def time_decode(triton_ops, batch: int, ctx: int, iters: int, copy_gbs: float, rows, **triton_kwargs) -> None:
    """Decode attention's K/V bytes read per second, Triton (with any forced options) and the torch reference."""
    dtype = torch.bfloat16
    kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * dtype.itemsize
    sets = rotations(lambda: paged_scene(batch, ctx, dtype, DEVICE)[:4], kv_bytes)
    runs = [
        (
            f"triton {triton_kwargs or ''}",
            functools.partial(triton_ops.paged_decode_attention, **triton_kwargs),
        )
    ]
    if not triton_kwargs:
        runs.append(("torch ref", kernel_backend.TORCH.paged_decode_attention))
    for name, decode in runs:
        ms = cuda_time_ms(
            lambda q, kv, t, lens, decode=decode: decode(q, kv, t, lens, HEAD_DIM**-0.5), sets, iters
        )
        gbs = kv_bytes / ms / 1e6
        rows.append(
            [
                f"decode {name} b{batch}x{ctx}",
                f"{ms:.3f} ms",
                f"{gbs:.0f} GB/s",
                f"{gbs / copy_gbs:.0%} of copy",
            ]
        )


def time_prefill(triton_ops, batch: int, seq_len: int, iters: int, rows) -> None:
    """Whole-prompt prefill over the paged cache against SDPA on the same dense causal shapes."""
    dtype = torch.bfloat16
    flops = 2 * batch * HEADS * HEAD_DIM * seq_len * seq_len  # QK^T and PV, 2 flops a MAC, half of it causal
    set_bytes = 3 * batch * seq_len * HEADS * HEAD_DIM * dtype.itemsize
    sets = rotations(lambda: paged_scene(batch, seq_len, dtype, DEVICE, seq_len), set_bytes)

    def paged(query, kv_cache, block_tables, context_lens, query_start_loc):
        return triton_ops.paged_prefill_attention(
            query,
            kv_cache,
            block_tables,
            query_start_loc,
            context_lens,
            HEAD_DIM**-0.5,
            max_query_len=seq_len,
        )

    def sdpa(query, key, value):
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, enable_gqa=True
        )

    dense = [
        tuple(
            torch.randn(batch, h, seq_len, HEAD_DIM, device=DEVICE, dtype=dtype)
            for h in (HEADS, KV_HEADS, KV_HEADS)
        )
        for _ in sets
    ]
    ms, sdpa_ms = cuda_time_ms(paged, sets, iters), cuda_time_ms(sdpa, dense, iters)
    label = f"b{batch}x{seq_len}"
    rows.append(
        [
            f"prefill triton {label}",
            f"{ms:.3f} ms",
            f"{flops / ms / 1e9:.0f} TFLOP/s",
            f"{ms / sdpa_ms:.2f}x SDPA's time",
        ]
    )
    rows.append([f"prefill SDPA {label}", f"{sdpa_ms:.3f} ms", f"{flops / sdpa_ms / 1e9:.0f} TFLOP/s", ""])


# ---------------------------------------------------------------- engine


def engine_smoke_test(rows) -> None:
    """TP=1 engine on CUDA: Triton kernels and torch references generate the same greedy tokens."""
    from engine import LLM, SamplingParams
    from engine.checkpoint.random_model import make_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_model("llama", "tiny", Path(tmp)))
        prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((5, 37, 120))]
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        tokens = {}
        for name in ("triton", "torch"):
            llm = LLM(
                model=model_dir,
                dtype="float32",
                kernel_backend=name,
                device=DEVICE,
                max_num_batched_tokens=64,
            )
            tokens[name] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    if tokens["triton"] != tokens["torch"]:
        raise Mismatch(f"engine greedy tokens differ: triton {tokens['triton']} vs torch {tokens['torch']}")
    rows.append(["engine TP=1 greedy, triton == torch", "same tokens"])


# ---------------------------------------------------------------- compile only


def compile_for_hopper() -> list[list[str]]:
    """Run every wrapper on meta tensors, capture its launches, and compile each one for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from kernels.decode_attention_triton import _decode_partition_kernel

    if not isinstance(_decode_partition_kernel, JITFunction):
        raise SystemExit("--compile-only needs TRITON_INTERPRET unset")
    launches = []
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append((self, args, kwargs))
    ops, meta = kernel_backend.get_backend("triton", "cuda"), "meta"
    for dtype in (torch.bfloat16, torch.float32):
        query, kv_cache, tables, lens, qsl = paged_scene(4, 100, dtype, meta, 1)
        ops.paged_decode_attention(query, kv_cache, tables, lens, 0.1, num_splits=1)
        ops.paged_decode_attention(query, kv_cache, tables, lens, 0.1, num_splits=3)
        ops.paged_prefill_attention(query, kv_cache, tables, qsl, lens, 0.1, max_query_len=1)
        ops.write_kv_cache(
            query[:, :KV_HEADS], query[:, :KV_HEADS], kv_cache, torch.zeros(4, dtype=torch.long, device=meta)
        )
        ops.rms_norm(query[:, 0], torch.ones(HEAD_DIM, dtype=dtype, device=meta), 1e-5, residual=query[:, 1])
        cos_sin = torch.empty(64, HEAD_DIM, device=meta)
        ops.rotary_embedding(
            torch.zeros(4, dtype=torch.long, device=meta), query, query[:, :KV_HEADS], cos_sin
        )
        ops.silu_and_mul(query[:, :2].reshape(4, -1))
    rows4 = torch.empty(4, device=meta)
    ops.sample_tokens(  # float32 logits whatever the model's dtype: compiled once
        torch.empty(4, 1000, device=meta), rows4, torch.empty(4, dtype=torch.int32, device=meta), rows4, rows4,
        torch.empty(4, dtype=torch.float64, device=meta),
    )
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64",
             torch.float64: "fp64"}
    rows = []
    for fn, args, kwargs in launches:
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        values = dict(zip(fn.arg_names, args)) | kwargs
        signature, constexprs = {}, {}
        for index, name in enumerate(fn.arg_names):
            value = values[name]
            if index in fn.constexprs:
                signature[name], constexprs[(index,)] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = "*" + names[value.dtype]
            else:
                signature[name] = "fp32" if isinstance(value, float) else "i32"
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        shared = compiled.metadata.shared
        if shared > 227 * 1024:
            raise Mismatch(f"{fn.__name__} needs {shared} bytes of shared memory, over Hopper's 227 KiB")
        dtype = next(kind for kind in signature.values() if kind.startswith("*"))[1:]
        variant = " split-K" if values.get("SPLIT") else ""
        rows.append([f"compiled {fn.__name__}{variant}, {dtype} output, sm_90", f"{shared} B shared memory"])
    return rows


def print_table(rows: list[list[str]], out: Path | None) -> None:
    width = max(len(row) for row in rows)
    lines = ["| " + " | ".join(row + [""] * (width - len(row))) + " |" for row in rows]
    lines.insert(0, "|" + " --- |" * width)
    lines.insert(0, "| " + " | ".join(["check"] + [""] * (width - 1)) + " |")
    print("\n".join(lines))
    if out:
        out.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compile_only:
        print_table(compile_for_hopper(), args.out)
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --compile-only to check the kernels compile)", file=sys.stderr)
        return 2
    if kernel_backend.triton_interpreter_enabled():
        print("gpu_check: unset TRITON_INTERPRET to run the kernels on the GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    triton_ops = kernel_backend.get_backend("triton", "cuda")
    rows: list[list[str]] = [[f"device: {torch.cuda.get_device_name(0)}"]]
    try:
        check_correctness(triton_ops, rows)
        copy_gbs = copy_bandwidth_gbs(args.iters)
        rows.append(["device-to-device copy (2 GiB)", "", f"{copy_gbs:.0f} GB/s", "100% of copy"])
        time_decode(triton_ops, 64, 2048, args.iters, copy_gbs, rows)
        time_decode(triton_ops, 4, 32768, args.iters, copy_gbs, rows)
        time_decode(triton_ops, 4, 32768, args.iters, copy_gbs, rows, num_splits=1)
        time_prefill(triton_ops, 4, 2048, args.iters, rows)
        if not args.skip_engine:
            engine_smoke_test(rows)
    except Mismatch as error:
        print_table(rows, args.out)
        print(f"gpu_check: MISMATCH: {error}", file=sys.stderr)
        return 1
    print_table(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
