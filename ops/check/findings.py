"""What a check reports: one mistake, where it is, and what to change."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Finding:
    rule: str  # short id, e.g. "undeclared-variable"
    where: str  # path[:line] relative to the repository root where possible
    message: str

    def __str__(self) -> str:
        return f"{self.where}: [{self.rule}] {self.message}"


def where(path: Path, line: int | None = None, root: Path | None = None) -> str:
    """`path:line`, relative to `root` when `path` is under it."""
    shown = path
    if root is not None:
        try:
            shown = path.resolve().relative_to(root.resolve())
        except ValueError:
            pass
    return f"{shown}:{line}" if line else str(shown)
