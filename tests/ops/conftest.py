"""Fixtures for the ops checks: a scratch copy of the ops tree to plant one mistake in.

Also puts the repository root on sys.path: `ops` is not part of the installed distribution.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


class OpsTree:
    """A copy of ops/terraform, configs/ and the Dockerfile under a temporary root."""

    def __init__(self, root: Path):
        self.root = root
        shutil.copytree(REPO / "ops" / "terraform", root / "ops" / "terraform")
        shutil.copytree(REPO / "configs", root / "configs")
        shutil.copy(REPO / "Dockerfile", root / "Dockerfile")

    def edit(self, relative: str, old: str, new: str) -> None:
        """Replace the one occurrence of `old` in the file (fails when it is not there)."""
        path = self.root / relative
        text = path.read_text()
        assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times in {relative}"
        path.write_text(text.replace(old, new))


@pytest.fixture
def ops_tree(tmp_path: Path) -> OpsTree:
    return OpsTree(tmp_path)
