"""Prefix caching pieces: chained block hashes and the free-block queue that is also the eviction order.

A full block is named by a hash of its tokens chained with its parent block's hash, so a block
is only reused under the same history. A freed block keeps its contents and hash and sits in
the free queue until the pool needs it.

Eviction order (the front of the free queue is handed out first):
1. blocks that hold nothing reusable: never used, a partial or uncomputed tail, or a full block
   whose hash another block already registered;
2. cached-free blocks, least recently freed first; within one sequence's release its tail
   blocks come before its head blocks, so the shared head of a prompt outlives its tail.
A cache hit takes a block out of the middle of the queue (it is revived, not copied); when it is
freed again it joins the back, as the most recently used.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from engine.sequence import Sequence


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """The name of a full block: its tokens, chained to the hash of the block before it."""
    digest = hashlib.blake2b(parent_hash or b"", digest_size=16)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.digest()


def full_block_hashes(seq: Sequence, block_size: int) -> list[bytes]:
    """Hashes of every full block of `seq`'s tokens; each block is hashed once, then remembered."""
    hashes = seq.block_hashes
    num_full = seq.num_tokens // block_size
    while len(hashes) < num_full:
        start = len(hashes) * block_size
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, seq.token_ids[start : start + block_size]))
    return hashes


class FreeBlockQueue:
    """Free device blocks in eviction order; O(1) pop from the front, removal from anywhere."""

    def __init__(self, block_ids: Iterable[int]):
        self._order: OrderedDict[int, None] = OrderedDict.fromkeys(block_ids)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._order

    def __iter__(self):
        return iter(self._order)

    def pop_front(self) -> int:
        block_id, _ = self._order.popitem(last=False)
        return block_id

    def push_back(self, block_id: int) -> None:
        """A cached-free block: evicted after everything already queued."""
        self._order[block_id] = None

    def push_front(self, block_id: int) -> None:
        """A block with nothing reusable in it: handed out before any cached block."""
        self._order[block_id] = None
        self._order.move_to_end(block_id, last=False)

    def remove(self, block_id: int) -> None:
        del self._order[block_id]
