"""Step time of tensor-parallel sizes 1, 2 and 4 on the bench model (CPU, gloo), and what each step
all-reduces; prints a table and rewrites the tensor-parallel block of docs/BENCHMARKS.md.

    python -m scripts.bench_tp [--tp 1,2,4] [--decode-batch 8] [--prefill-tokens 128] [--no-docs]

Two step kinds are timed through the engine (`LLMEngine.step`, so scheduling, the metadata
broadcast and sampling are included): a decode step of `--decode-batch` sequences (one token
each) and a prefill step of one `--prefill-tokens`-token prompt. The median of `--repeats` steps
is reported.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"
BEGIN = "<!-- tp-bench:begin (written by scripts/bench_tp.py) -->"
END = "<!-- tp-bench:end -->"
DTYPE = "float32"  # CPU: bfloat16 matmuls are slow without AVX512-BF16/AMX
DTYPE_BYTES = 4


def allreduced_bytes(num_layers: int, num_tokens: int, hidden: int, dtype_bytes: int = DTYPE_BYTES) -> int:
    """Bytes entering the row-parallel all-reduces of one step: o_proj and down_proj per layer."""
    return 2 * num_layers * num_tokens * hidden * dtype_bytes


def _time_steps(engine, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def measure(model_dir: Path, tp: int, decode_batch: int, prefill_tokens: int, repeats: int) -> dict:
    """Median decode-step and prefill-step seconds of one engine at tensor-parallel size `tp`."""
    from engine.config import SamplingParams
    from engine.llm_engine import LLM

    llm = LLM(
        str(model_dir),
        tensor_parallel_size=tp,
        dtype=DTYPE,
        max_model_len=1024,
        num_kv_blocks=512,
        max_num_batched_tokens=max(prefill_tokens, 512),
    )
    engine = llm.engine
    config = engine.model_config
    try:
        # prefill: one fresh prompt per step, nothing else running
        prefill_times = []
        for i in range(repeats + 1):
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            engine.add_request(f"prefill-{i}", [(7 * i + t) % 30000 + 3 for t in range(prefill_tokens)], params)
            prefill_times += _time_steps(engine, 1)
        # decode: `decode_batch` sequences past their (short) prefill, one token each per step
        params = SamplingParams(temperature=0.0, max_tokens=repeats + 4, ignore_eos=True)
        for i in range(decode_batch):
            engine.add_request(f"decode-{i}", [(11 * i + t) % 30000 + 3 for t in range(16)], params)
        engine.step()  # all prompts in one prefill step
        decode_times = _time_steps(engine, repeats)
    finally:
        llm.shutdown()
    return dict(
        tp=tp,
        decode_ms=1000 * statistics.median(decode_times),
        prefill_ms=1000 * statistics.median(prefill_times[1:]),  # the first step warms up
        decode_bytes=allreduced_bytes(config.num_hidden_layers, decode_batch, config.hidden_size),
        prefill_bytes=allreduced_bytes(config.num_hidden_layers, prefill_tokens, config.hidden_size),
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
    )


def _kib(n: int) -> str:
    return f"{n / 1024:,.0f} KiB"


def table(rows: list[dict], decode_batch: int, prefill_tokens: int) -> str:
    base = rows[0]
    lines = [
        f"| TP | decode step ({decode_batch} seqs) | vs TP={base['tp']} | all-reduced / decode step "
        f"| prefill step ({prefill_tokens} tokens) | vs TP={base['tp']} | all-reduced / prefill step |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['tp']} | {row['decode_ms']:.1f} ms | {row['decode_ms'] / base['decode_ms']:.2f}x "
            f"| {_kib(row['decode_bytes']) if row['tp'] > 1 else '0'} "
            f"| {row['prefill_ms']:.1f} ms | {row['prefill_ms'] / base['prefill_ms']:.2f}x "
            f"| {_kib(row['prefill_bytes']) if row['tp'] > 1 else '0'} |"
        )
    return "\n".join(lines)


def collectives_per_step(num_layers: int) -> int:
    """Step broadcast (length + bytes), o_proj and down_proj all-reduces, embedding all-reduce, logits all-gather."""
    return 2 + 2 * num_layers + 1 + 1


def overhead_lines(rows: list[dict]) -> list[str]:
    """Each TP size's step time above an ideal 1/tp split of TP=1's, per collective of the step."""
    base = next((row for row in rows if row["tp"] == 1), None)
    if base is None:
        return []
    lines = []
    for row in rows:
        if row["tp"] == 1:
            continue
        count = collectives_per_step(row["layers"])
        parts = []
        for kind in ("decode", "prefill"):
            extra = row[f"{kind}_ms"] - base[f"{kind}_ms"] / row["tp"]
            parts.append(f"{kind} {extra:.1f} ms ({extra / count:.2f} ms per collective)")
        lines.append(f"- TP={row['tp']}: time over TP=1 / {row['tp']}: " + ", ".join(parts) + f", {count} collectives a step")
    return lines


def machine() -> str:
    import torch

    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, Linux {platform.release()}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} thread(s) in rank 0, 1 in each worker), "
        f"load average {os.getloadavg()[0]:.1f} at the end"
    )


def write_docs(block: str, doc: Path = DOC) -> None:
    """Replace the text between the tp-bench markers (the rest of the file is left as it is)."""
    text = doc.read_text()
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} block to rewrite")
    doc.write_text(pattern.sub(lambda _: f"{BEGIN}\n{block}\n{END}", text, count=1))


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", default="1,2,4", help="comma-separated tensor-parallel sizes")
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--prefill-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the bench model)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of rank 0 (Ray gives each worker rank one)"
    )
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

    import ray
    import torch

    from engine.checkpoint.random_model import ensure_bench_model

    # one thread per rank, as the workers get: on a shared 2-core machine two OpenMP threads
    # spin at every op's barrier and TP=1 would measure that instead of its arithmetic
    torch.set_num_threads(args.threads)

    sizes = [int(s) for s in args.tp.split(",")]
    # CPU bundles are logical: room for the largest engine's ranks whatever the core count
    ray.init(include_dashboard=False, num_cpus=max(*sizes, os.cpu_count() or 1), logging_level="WARNING")

    model_dir = args.model or ensure_bench_model()
    rows = []
    for tp in sizes:
        rows.append(measure(model_dir, tp, args.decode_batch, args.prefill_tokens, args.repeats))
        print(f"TP={tp}: decode {rows[-1]['decode_ms']:.1f} ms, prefill {rows[-1]['prefill_ms']:.1f} ms", file=sys.stderr)
    command = "python -m scripts.bench_tp " + " ".join(argv if argv is not None else sys.argv[1:])
    overhead = "\n".join(overhead_lines(rows))
    block = (
        f"{table(rows, args.decode_batch, args.prefill_tokens)}\n\n"
        + (f"{overhead}\n\n" if overhead else "")
        + f"`{command.strip()}` on {machine()}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"model {model_dir.name} ({rows[0]['layers']} layers, hidden {rows[0]['hidden']}), {DTYPE}, "
        f"median of {args.repeats} steps. All-reduced bytes = 2 × layers × tokens × hidden × 4 (o_proj and "
        f"down_proj); the vocab-parallel embedding adds one more tokens × hidden all-reduce per step."
    )
    print(block)
    if not args.no_docs:
        write_docs(block)
    ray.shutdown()
    return block


if __name__ == "__main__":
    main()
