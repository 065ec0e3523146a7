"""A prompt's full-block hashes exactly as the engine's prefix cache names them (engine/prefix_cache.py)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.prefix_cache import hash_block


def prompt_block_hashes(prompt_token_ids: Sequence[int], block_size: int) -> tuple[bytes, ...]:
    """Chained hashes of every full `block_size`-token block of the prompt; a partial tail block has none."""
    hashes: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(prompt_token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, list(prompt_token_ids[start : start + block_size]))
        hashes.append(parent)
    return tuple(hashes)
