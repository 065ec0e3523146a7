"""Paged KV blocks: a free pool, append-only block tables, reference counts.

One BlockManager per engine, beside the scheduler; block ids mean the same on every TP rank.
A sequence's block table covers its first `num_computed_tokens + num_new_tokens` tokens;
blocks are appended as it grows and all returned when it finishes or is preempted.
"""

from __future__ import annotations

from collections import deque

from engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # New requests are admitted only while this many blocks stay free, so running
        # sequences can keep decoding a while before anyone is preempted.
        self.watermark_blocks = int(watermark * num_blocks)
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to append so the table covers the tokens computed after this step."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, admitting: bool = False) -> bool:
        """Grow `seq`'s block table for `num_new_tokens` more computed tokens; False if the pool is short.

        `admitting` (a request leaving WAITING) also keeps the watermark free.
        """
        num_new = self.num_new_blocks(seq, num_new_tokens)
        reserve = self.watermark_blocks if admitting else 0
        if num_new + reserve > self.num_free_blocks:
            return False
        for _ in range(num_new):
            block_id = self.free_block_ids.popleft()
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)
        return True

    def free(self, seq: Sequence) -> None:
        """Return every block of `seq` to the pool (its table becomes empty)."""
        for block_id in seq.block_table:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        seq.block_table = []

    def check_invariants(self) -> None:
        """Every block is either free with ref count 0 or held; no block is free twice (for tests)."""
        free = set(self.free_block_ids)
        assert len(free) == len(self.free_block_ids), "a block is in the free pool twice"
        for block_id, count in enumerate(self.ref_counts):
            assert count >= 0, f"block {block_id} has ref count {count}"
            assert (count == 0) == (block_id in free), f"block {block_id}: ref count {count}, free={block_id in free}"
