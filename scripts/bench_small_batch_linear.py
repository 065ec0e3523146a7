"""A decode step's matrix products at a few rows: oneDNN's packed product against the native small-batch ones (part
of `make bench`).

    python -m scripts.bench_small_batch_linear [--write-doc]

Every linear weight of a decode step, as the engine holds them (kernels/linear.py): the demo model's (SmolLM2-135M:
30 layers of QKV 576 -> 960, O 576 -> 576, gate/up 576 -> 3072, down 1536 -> 576, and the tied LM head 576 -> 49152)
and the bench model's (8 layers of hidden 512, intermediate 1408, LM head 512 -> 32000), random, in bfloat16 and in
float32. One call multiplies every weight of the step once, in the model's order, so each weight comes from memory
as it does in a served step (the demo model's are ~270 MB in bfloat16), not from a cache that one weight called
again and again would sit in. The products alternate, --repeats rounds each; the table has the medians: oneDNN's
packed product, the native vector product on the weight as it is (`small_batch_linear`, up to 16 rows), the AMX tile
product on the weight laid out as tiles (`amx_small_batch_linear`, bfloat16 where the CPU has AMX, every row count
here), and which of them the engine runs at that row count (SMALL_BATCH_MAX_ROWS, AMX_SMALL_BATCH_MAX_ROWS).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels import cpu_native
from kernels.linear import AMX_SMALL_BATCH_MAX_ROWS, PackedLinearWeight, onednn_linear, small_batch_kernels
from scripts.doc_blocks import rewrite_block, timing_body

BEGIN, END = "<!-- small-batch-linear:begin -->", "<!-- small-batch-linear:end -->"
MODELS = {  # name -> (layers, [(out, in) of a layer's products], LM head (out, in))
    "demo model": (30, [(960, 576), (576, 576), (3072, 576), (576, 1536)], (49152, 576)),
    "bench model": (8, [(1024, 512), (512, 512), (2816, 512), (512, 1408)], (32000, 512)),
}
ROWS = (1, 2, 4, 6, 8, 10, 16, 32, 48, 64, 80, 96, 128)
VECTOR_MAX_ROWS = 16  # past it the vector product is arithmetic-bound (and far slower than oneDNN's): not timed


def step_weights(model: str, dtype: torch.dtype, generator: torch.Generator) -> list[torch.Tensor]:
    layers, shapes, head = MODELS[model]
    return [torch.randn(shape, generator=generator).to(dtype) * 0.02 for shape in [*shapes * layers, head]]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def time_model(model: str, dtype: torch.dtype, generator: torch.Generator, repeats: int, native) -> list[str]:
    """One table row per row count: every product over every weight of `model`'s decode step."""
    weights = step_weights(model, dtype, generator)
    try:
        packed = [PackedLinearWeight(w).packed for w in weights]
    except RuntimeError:  # bfloat16 where oneDNN cannot pack it (AVX2 alone): the engine runs F.linear there
        print(f"{dtype}: oneDNN cannot pack it on this CPU; not timed", flush=True)
        return []
    amx = dtype == torch.bfloat16 and native.amx_linear_available()
    tiles = [native.amx_weight_tiles(w) for w in weights] if amx else []
    engine_kernel = small_batch_kernels(native)[dtype]
    rows = []
    for count in ROWS:
        inputs = {n: torch.randn(count, n, generator=generator).to(dtype) for n in {w.shape[1] for w in weights}}
        products = {
            "oneDNN": lambda xs=inputs: [onednn_linear(xs[w.shape[1]], p, None) for w, p in zip(weights, packed,
                                                                                                  strict=True)],
        }
        if count <= VECTOR_MAX_ROWS:
            products["vector"] = lambda xs=inputs: [native.small_batch_linear(xs[w.shape[1]], w, None) for w in weights]
        if amx:
            products["AMX"] = lambda xs=inputs: [native.amx_small_batch_linear(xs[w.shape[1]], t, w.shape[0], None)
                                                 for w, t in zip(weights, tiles, strict=True)]
        for product in products.values():  # warm-up (oneDNN's primitive for this row count)
            product()
        times = {name: [] for name in products}
        for _ in range(repeats):
            for name, product in products.items():
                times[name].append(timed(product))
        ms = {name: statistics.median(values) for name, values in times.items()}
        if count > engine_kernel.max_rows:
            used = "oneDNN"
        else:
            used = "AMX" if engine_kernel.max_rows == AMX_SMALL_BATCH_MAX_ROWS and amx else "vector"
        vector_cell, amx_cell = (f"{ms[name]:.2f}" if name in ms else "-" for name in ("vector", "AMX"))
        rows.append(f"| {str(dtype).removeprefix('torch.')} | {model} | {count} | {ms['oneDNN']:.2f} | "
                    f"{vector_cell} | {amx_cell} | {ms[used] / ms['oneDNN']:.2f} | {used} |")
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--models", default=",".join(MODELS), help="whose weights (default: both)")
    parser.add_argument("--write-doc", action="store_true")
    args = parser.parse_args(argv)
    native = cpu_native.load()
    if native is None:
        raise SystemExit("the native CPU kernels are not built on this machine (kernels/cpu_native.py)")
    generator = torch.Generator().manual_seed(0)
    rows = []
    for dtype in [getattr(torch, name) for name in args.dtypes.split(",")]:
        for model in args.models.split(","):
            rows += time_model(model, dtype, generator, args.repeats, native)
    body = timing_body(
        f"{args.dtypes.replace(',', ' and ')}, a call: every weight of the step once",
        ["dtype", "weights", "rows", "oneDNN packed ms", "vector ms", "AMX ms", "the engine's / oneDNN's",
         "the engine runs"],
        rows,
        args.repeats,
        1,
        "python -m scripts.bench_small_batch_linear --write-doc",
    )
    if args.write_doc:
        rewrite_block(BEGIN, END, body, "Linears at batch 1-128: the native products on a second copy of the weight")


if __name__ == "__main__":
    main()
