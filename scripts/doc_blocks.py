"""Rewrite one benchmark's marked block in docs/BENCHMARKS.md, leaving every other section alone."""

from __future__ import annotations

import datetime
import platform
from pathlib import Path

import torch

BENCHMARKS_DOC = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"


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
            f"Measured {now:%Y-%m-%d %H:%M} UTC on {platform.machine()} ({torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}), {inputs}, median of {repeats} alternated rounds of {calls} calls.",
            "",
            "| " + " | ".join(columns) + " |",
            "|---" * len(columns) + "|",
            *rows,
            "",
            f"Command: `{command}` (in `make bench`)",
        ]
    )
