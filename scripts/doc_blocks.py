"""Rewrite one benchmark's marked block in docs/BENCHMARKS.md, leaving every other section alone."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

import torch

BENCHMARKS_DOC = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"


def vector_isa_summary() -> str:
    """What the benchmarks' CPU multiplies with, as the figures depend on it: AMX, AVX-512 (with or without
    avx512_bf16) or AVX2 (the CPU differs from day to day on these machines)."""
    from kernels.cpu_native import cpu_flags

    flags = cpu_flags()
    if "amx_bf16" in flags:
        return "AVX-512 with avx512_bf16 and AMX"
    if "avx512f" in flags:
        return "AVX-512" + (" with avx512_bf16" if "avx512_bf16" in flags else ", no avx512_bf16")
    return "AVX2" if "avx2" in flags else "no AVX2"


def cpu_description() -> str:
    """The machine beside a figure: cores, the CPU's model name and its vector ISA."""
    model = platform.processor() or "CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {model} ({vector_isa_summary()})"


def rewrite_block(begin: str, end: str, body: str, heading: str, doc: Path = BENCHMARKS_DOC) -> None:
    """Replace the text between the `begin` and `end` markers with `body`; append a new `heading`
    section holding the block when the doc has no such markers yet."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"{begin}\n{body}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text += f"\n## {heading}\n\n{block}\n"
    doc.write_text(text)


def timing_body(inputs: str, columns: list[str], rows: list[str], repeats: int, calls: int, command: str) -> str:
    """A micro-benchmark's block: when and where, its markdown table (`rows` already formatted), the command."""
    now = datetime.datetime.now(datetime.UTC)
    return "\n".join(
        [
            f"Measured {now:%Y-%m-%d %H:%M} UTC on {cpu_description()} ({torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}), {inputs}, median of {repeats} alternated rounds of {calls} calls.",
            "",
            "| " + " | ".join(columns) + " |",
            "|---" * len(columns) + "|",
            *rows,
            "",
            f"Command: `{command}` (in `make bench`)",
        ]
    )
