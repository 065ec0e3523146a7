"""Native CPU kernels vs the torch references, op by op, on the bench model's shapes (part of `make bench`).

    python -m scripts.bench_cpu_kernels [--write-doc]

Times each op of the `cpu` backend (kernels/cpu/*.cpp, oneDNN pre-packed weights) against the `torch`
reference on the same inputs, alternating the two, and prints the median of --repeats rounds (each
round the mean of --calls calls) and their ratio. Shapes: 8 query / 4 KV heads, head_dim 64, hidden 512,
intermediate 1408, blocks of 16 scattered over the cache as a busy server's are; in the dtype `--dtype auto` runs
the bench model in here (bfloat16 where the CPU multiplies it natively, else float32), or --dtype's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kernels.backend import TORCH, cpu_supports_bf16, get_backend
from kernels.linear import linear
from kernels.rotary import rope_cos_sin_cache
from scripts.doc_blocks import rewrite_block, timing_body

BEGIN, END = "<!-- cpu-kernels:begin -->", "<!-- cpu-kernels:end -->"
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, BLOCK = 8, 4, 64, 512, 1408, 16


def timed(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def paged_scene(num_seqs: int, context: int, generator: torch.Generator, dtype: torch.dtype):
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = num_seqs * blocks_per_seq + 8
    kv_cache = torch.randn(2, KV_HEADS, num_blocks, BLOCK, HEAD_DIM, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator)[: num_seqs * blocks_per_seq]
    return kv_cache, order.view(num_seqs, blocks_per_seq).to(torch.int32)


def cases(generator: torch.Generator, dtype: torch.dtype):
    """(label, reference call, native call)."""
    native = get_backend("cpu", "cpu")
    for batch, context in [(10, 576), (50, 576)]:
        kv, tables = paged_scene(batch, context, generator, dtype)
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=generator).to(dtype)
        lens = torch.full((batch,), context, dtype=torch.int32)
        yield (
            f"decode attention, batch {batch} × context {context}",
            lambda q=q, kv=kv, t=tables, n=lens: TORCH.paged_decode_attention(q, kv, t, n, 0.125),
            lambda q=q, kv=kv, t=tables, n=lens: native.paged_decode_attention(q, kv, t, n, 0.125),
        )
    for cached, new in [(0, 512), (512, 512)]:
        kv, tables = paged_scene(1, cached + new, generator, dtype)
        q = torch.randn(new, HEADS, HEAD_DIM, generator=generator).to(dtype)
        starts = torch.tensor([0, new], dtype=torch.int32)
        lens = torch.tensor([cached + new], dtype=torch.int32)
        yield (
            f"prefill attention, {new} new tokens on {cached} cached",
            lambda q=q, kv=kv, t=tables, s=starts, n=lens: TORCH.paged_prefill_attention(q, kv, t, s, n, 0.125),
            lambda q=q, kv=kv, t=tables, s=starts, n=lens: native.paged_prefill_attention(q, kv, t, s, n, 0.125),
        )
    # a prefill step of 16 prompts of 512 tokens (2 steps of the engine's 8192-token budget: 64 x 512 offline)
    batch, new = 16, 512
    kv, tables = paged_scene(batch, new, generator, dtype)
    q = torch.randn(batch * new, HEADS, HEAD_DIM, generator=generator).to(dtype)
    starts = torch.arange(batch + 1, dtype=torch.int32) * new
    lens = torch.full((batch,), new, dtype=torch.int32)
    yield (
        f"prefill attention, {batch} prompts of {new} tokens",
        lambda q=q, kv=kv, t=tables, s=starts, n=lens: TORCH.paged_prefill_attention(q, kv, t, s, n, 0.125),
        lambda q=q, kv=kv, t=tables, s=starts, n=lens: native.paged_prefill_attention(q, kv, t, s, n, 0.125),
    )
    # speculative verification: 10 sequences, each its last token and 4 proposals on 571 cached (as the model
    # calls it, with the longest chunk known: the engine's backend keeps such short chunks native on AMX too)
    batch, new, cached = 10, 5, 571
    kv, tables = paged_scene(batch, cached + new, generator, dtype)
    q = torch.randn(batch * new, HEADS, HEAD_DIM, generator=generator).to(dtype)
    starts = torch.arange(batch + 1, dtype=torch.int32) * new
    lens = torch.full((batch,), cached + new, dtype=torch.int32)
    yield (
        f"prefill attention, {batch} verifications of {new} tokens on {cached} cached",
        lambda q=q, kv=kv, t=tables, s=starts, n=lens: TORCH.paged_prefill_attention(q, kv, t, s, n, 0.125),
        lambda q=q, kv=kv, t=tables, s=starts, n=lens: native.paged_prefill_attention(
            q, kv, t, s, n, 0.125, max_query_len=new),
    )
    cos_sin = rope_cos_sin_cache(HEAD_DIM, 4096, 10000.0)
    for tokens in (10, 512):
        x = torch.randn(tokens, HIDDEN, generator=generator).to(dtype)
        residual = torch.randn(tokens, HIDDEN, generator=generator).to(dtype)
        weight = torch.randn(HIDDEN, generator=generator).to(dtype)
        gate_up = torch.randn(tokens, 2 * INTERMEDIATE, generator=generator).to(dtype)
        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator).to(dtype)
        q, k, _ = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        q, k = q.view(tokens, HEADS, HEAD_DIM), k.view(tokens, KV_HEADS, HEAD_DIM)
        positions = torch.arange(tokens, dtype=torch.int64)
        yield (
            f"RMSNorm + residual, {tokens} tokens",
            lambda x=x, w=weight, r=residual: TORCH.rms_norm(x, w, 1e-6, r),
            lambda x=x, w=weight, r=residual: native.rms_norm(x, w, 1e-6, r),
        )
        yield (
            f"SiLU-and-mul, {tokens} tokens",
            lambda g=gate_up: TORCH.silu_and_mul(g),
            lambda g=gate_up: native.silu_and_mul(g),
        )
        yield (
            f"rotary (query and key), {tokens} tokens",
            lambda p=positions, q=q, k=k: TORCH.rotary_embedding(p, q, k, cos_sin),
            lambda p=positions, q=q, k=k: native.rotary_embedding(p, q, k, cos_sin),
        )
    # a decode step's matrix products: 8 layers' QKV, O, gate/up, down, and the LM head
    shapes = [(1024, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * 8
    weights = [torch.randn(s, generator=generator).to(dtype) * 0.02 for s in [*shapes, (32000, HIDDEN)]]
    # as the engine packs them: where memory allows, every layer keeps the second copy its small-batch kernel reads
    # (bfloat16 on AMX: tiles, up to 96 rows; else the weight as it is, up to 4 bfloat16 or 8 float32 rows; the LM head
    # its dense weight; kernels/linear.py)
    packed = [native.pack_linear_weight(w, keep_dense=True) for w in weights]
    for tokens in (1, 4, 10, 50):
        inputs = {n: torch.randn(tokens, n, generator=generator).to(dtype) for n in (HIDDEN, INTERMEDIATE)}
        yield (
            f"a decode step's linears (8 layers + LM head), batch {tokens}",
            lambda xs=inputs: [F.linear(xs[w.shape[1]], w) for w in weights],
            lambda xs=inputs: [linear(xs[w.shape[1]], w, None, p) for w, p in zip(weights, packed, strict=True)],
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"],
                        help="default: bfloat16 where the CPU multiplies it natively, else float32 (as --dtype auto)")
    parser.add_argument("--write-doc", action="store_true")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cpu_supports_bf16() else torch.float32)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for label, reference, native in cases(generator, dtype):
        reference(), native()  # warm-up (and the extension's build, the first time)
        ref_ms, native_ms = [], []
        for _ in range(args.repeats):
            ref_ms.append(timed(reference, args.calls))
            native_ms.append(timed(native, args.calls))
        ref, nat = statistics.median(ref_ms), statistics.median(native_ms)
        rows.append(f"| {label} | {ref:.3f} | {nat:.3f} | {ref / nat:.1f}× |")
        print(rows[-1], flush=True)
    body = timing_body(
        str(dtype).removeprefix("torch."),
        ["op", "torch reference ms", "native ms", "speed-up"],
        rows,
        args.repeats,
        args.calls,
        "python -m scripts.bench_cpu_kernels --write-doc",
    )
    if args.write_doc:
        rewrite_block(BEGIN, END, body, "Kernels: native CPU vs references")


if __name__ == "__main__":
    main()
