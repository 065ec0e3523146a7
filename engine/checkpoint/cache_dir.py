"""The one folder where models made or fetched on first use are kept."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where models made or fetched on first use live: $SHARDSERVE_CACHE, else ~/.cache/shardserve."""
    return Path(os.environ.get("SHARDSERVE_CACHE") or Path.home() / ".cache" / "shardserve").expanduser()
