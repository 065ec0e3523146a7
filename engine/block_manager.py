"""Paged KV blocks: a free pool, append-only block tables, reference counts, prefix hashes, host blocks.

One BlockManager per engine, beside the scheduler; block ids mean the same on every TP rank.
A sequence's block table covers its first `num_computed_tokens + num_new_tokens` tokens;
blocks are appended as it grows and all returned when it finishes or is preempted.

With prefix caching, full computed blocks are registered under their chained hash
(engine/prefix_cache.py); a new sequence starts with every cached block of its longest cached
prefix, shared by reference count. Freed blocks stay cached until the free queue hands them out.

With swap preemption, a sequence's blocks are copied to host blocks; the copy holds a reference
on each device block until the runner reports it finished (`complete_swap_out`), so no step
reuses a block that is still being read.
"""

from __future__ import annotations

from collections import deque

from engine.prefix_cache import FreeBlockQueue, full_block_hashes
from engine.sequence import Sequence


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
        num_host_blocks: int = 0,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # New requests are admitted only while this many blocks stay free, so running
        # sequences can keep decoding a while before anyone is preempted.
        self.watermark_blocks = int(watermark * num_blocks)
        self.free_queue = FreeBlockQueue(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached_blocks: dict[bytes, int] = {}  # hash -> the block holding it (live or cached-free)
        self.num_host_blocks = num_host_blocks
        self.free_host_block_ids: deque[int] = deque(range(num_host_blocks))
        self.swap_outs_in_flight: dict[int, list[int]] = {}  # ticket -> device blocks its copy reads
        # counters (tests, metrics)
        self.peak_num_used_blocks = 0
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks the pool can hand out now (cached-free blocks included)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached-free blocks do not count)."""
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to append so the table covers the tokens computed after this step."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    # ---- allocation -------------------------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks of the longest cached prefix of `seq`, never covering its last token."""
        if not self.enable_prefix_caching:
            return []
        hashes = full_block_hashes(seq, self.block_size)
        max_blocks = (seq.num_tokens - 1) // self.block_size  # the last token is always computed
        hits = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, admitting: bool = False, cached: list[int] = ()
    ) -> bool:
        """Grow `seq`'s block table for `num_new_tokens` more computed tokens; False if the pool is short.

        `cached` (from `cached_prefix`, for a sequence with an empty table) are taken first and
        their tokens count as computed. `admitting` (a request leaving WAITING) also keeps the
        watermark free.
        """
        num_cached_tokens = len(cached) * self.block_size
        needed = self.blocks_for(seq.num_computed_tokens + num_cached_tokens + num_new_tokens)
        num_new = max(0, needed - len(seq.block_table) - len(cached))
        num_revived = sum(1 for block_id in cached if self.ref_counts[block_id] == 0)
        reserve = self.watermark_blocks if admitting else 0
        if num_new + num_revived + reserve > self.num_free_blocks:
            return False
        for block_id in cached:
            if self.ref_counts[block_id] == 0:
                self.free_queue.remove(block_id)  # revived in place: its K/V are still there
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)
        if cached:
            seq.num_computed_tokens += num_cached_tokens
            seq.num_registered_blocks = len(seq.block_table)  # they are the cache's own blocks
        seq.block_table.extend(self._take_free_blocks(num_new))
        self.register_full_blocks(seq, seq.num_computed_tokens + num_new_tokens)
        self._note_usage()
        return True

    def _take_free_blocks(self, count: int) -> list[int]:
        """`count` blocks from the front of the free queue, in address order.

        The queue hands back a released sequence's blocks tail first (its eviction order), so taken as they
        come a new prompt's blocks would lie in descending order, and the CPU's prefetchers follow ascending
        address streams: decode attention over such tables takes 1.2-1.4x the time of the same blocks in
        ascending order (docs/BENCHMARKS.md, "Decode attention from memory"). Sorting changes which block
        holds which of the sequence's tokens, not which blocks are taken."""
        return sorted(self._take_free_block() for _ in range(count))

    def _take_free_block(self) -> int:
        block_id = self.free_queue.pop_front()
        block_hash = self.block_hash[block_id]
        if block_hash is not None:  # evict: the block is about to be overwritten
            del self.cached_blocks[block_hash]
            self.block_hash[block_id] = None
            self.num_evictions += 1
        self.ref_counts[block_id] = 1
        return block_id

    def _note_usage(self) -> None:
        self.peak_num_used_blocks = max(self.peak_num_used_blocks, self.num_used_blocks)

    def register_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Offer the blocks that are full once `num_computed_tokens` are computed to the prefix cache.

        Called when a step is scheduled: a sequence admitted in the same step may already reuse
        them, because every layer writes the whole batch's K/V before any token attends. The first
        block to register a hash keeps it; a duplicate stays unnamed.
        """
        if not self.enable_prefix_caching:
            return
        # a speculating chunk computes proposals past the sequence's tokens: only real tokens are hashed
        num_full = min(min(num_computed_tokens, seq.num_tokens) // self.block_size, len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return
        hashes = full_block_hashes(seq, self.block_size)
        for index in range(seq.num_registered_blocks, num_full):
            block_id, block_hash = seq.block_table[index], hashes[index]
            if self.block_hash[block_id] is None and block_hash not in self.cached_blocks:
                self.cached_blocks[block_hash] = block_id
                self.block_hash[block_id] = block_hash
        seq.num_registered_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Return every block of `seq` to the pool (its table becomes empty); computed blocks stay cached."""
        self.register_full_blocks(seq, seq.num_computed_tokens)
        self._release(seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def trim(self, seq: Sequence) -> None:
        """Return the blocks past `seq`'s computed tokens: those only its rejected proposals' slots needed."""
        keep = self.blocks_for(seq.num_computed_tokens)
        if len(seq.block_table) > keep:
            self._release(seq.block_table[keep:])
            del seq.block_table[keep:]

    def _release(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):  # tail first: a prompt's head outlives its tail
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.block_hash[block_id] is None:
                    self.free_queue.push_front(block_id)
                else:
                    self.free_queue.push_back(block_id)

    # ---- swap -------------------------------------------------------------------------------

    @property
    def num_free_host_blocks(self) -> int:
        return len(self.free_host_block_ids)

    @property
    def num_releasing_blocks(self) -> int:
        """Device blocks that return to the pool when the swap-outs in flight finish."""
        return sum(
            1 for blocks in self.swap_outs_in_flight.values() for block_id in blocks if self.ref_counts[block_id] == 1
        )

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= self.num_free_host_blocks

    def swap_out(self, seq: Sequence, ticket: int) -> list[tuple[int, int]]:
        """Give `seq`'s KV host blocks; returns (device block, host block) copies to run under `ticket`.

        The device blocks stay referenced by the copy until `complete_swap_out(ticket)`.
        """
        host_blocks = [self.free_host_block_ids.popleft() for _ in seq.block_table]
        pairs = list(zip(seq.block_table, host_blocks))
        self.swap_outs_in_flight.setdefault(ticket, []).extend(seq.block_table)
        seq.host_block_table = host_blocks
        seq.swap_out_ticket = ticket
        seq.block_table = []
        seq.num_registered_blocks = 0
        return pairs

    def complete_swap_out(self, ticket: int) -> None:
        """The copies of `ticket` finished: their device blocks may be reused."""
        self._release(self.swap_outs_in_flight.pop(ticket, []))

    def swap_out_finished(self, seq: Sequence) -> bool:
        return seq.swap_out_ticket not in self.swap_outs_in_flight

    def swap_in(self, seq: Sequence, num_new_tokens: int, admitting: bool = False) -> list[tuple[int, int]] | None:
        """Device blocks for a SWAPPED `seq` and its next tokens; (host, device) copies, or None if short."""
        num_swapped = len(seq.host_block_table)
        num_new = max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - num_swapped)
        reserve = self.watermark_blocks if admitting else 0
        if num_swapped + num_new + reserve > self.num_free_blocks:
            return None
        device_blocks = self._take_free_blocks(num_swapped + num_new)
        pairs = list(zip(seq.host_block_table, device_blocks))
        # the host blocks are read before anything can write them again: swap-ins run ahead of this
        # step's forward pass, later swap-outs behind it (and ranks guard it, engine/swap.py)
        self.free_host_block_ids.extend(seq.host_block_table)
        seq.host_block_table = []
        seq.swap_out_ticket = None
        seq.block_table = device_blocks
        seq.num_registered_blocks = 0
        self.register_full_blocks(seq, seq.num_computed_tokens + num_new_tokens)
        self._note_usage()
        return pairs

    def free_host(self, seq: Sequence) -> None:
        """Drop a SWAPPED sequence's host blocks (it finished or was aborted while swapped)."""
        self.free_host_block_ids.extend(seq.host_block_table)
        seq.host_block_table = []

    # ---- checks -----------------------------------------------------------------------------

    def check_invariants(self, live: list[Sequence] = ()) -> None:
        """Every block is free (ref 0) or held; hashes and the cache map agree (for tests).

        With `live` (every unfinished sequence), ref counts must equal the tables and copies
        holding each block, and no host block may be both free and held.
        """
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue), "a block is in the free pool twice"
        for block_id, count in enumerate(self.ref_counts):
            assert count >= 0, f"block {block_id} has ref count {count}"
            assert (count == 0) == (block_id in free), f"block {block_id}: ref count {count}, free={block_id in free}"
        for block_hash, block_id in self.cached_blocks.items():
            assert self.block_hash[block_id] == block_hash, f"block {block_id} lost its hash"
        assert sum(h is not None for h in self.block_hash) == len(self.cached_blocks), "a hash is not in the cache map"
        free_host = list(self.free_host_block_ids)
        assert len(set(free_host)) == len(free_host), "a host block is free twice"
        if live:
            expected = [0] * self.num_blocks
            for seq in live:
                for block_id in seq.block_table:
                    expected[block_id] += 1
            for blocks in self.swap_outs_in_flight.values():
                for block_id in blocks:
                    expected[block_id] += 1
            assert expected == self.ref_counts, "ref counts do not match the holders of each block"
            held_host = [h for seq in live for h in seq.host_block_table]
            assert len(set(held_host)) == len(held_host), "a host block is held twice"
            assert not set(held_host) & set(free_host), "a host block is both free and held"
            assert len(held_host) + len(free_host) == self.num_host_blocks, "a host block went missing"

    def check_all_free(self) -> None:
        """Nothing is held: every device and host block is free or cached-free (after a workload)."""
        self.check_invariants()
        assert not self.swap_outs_in_flight, f"swap-outs still in flight: {list(self.swap_outs_in_flight)}"
        assert all(count == 0 for count in self.ref_counts), "a device block is still referenced"
        assert self.num_free_blocks == self.num_blocks, "a device block is neither free nor cached-free"
        assert self.num_free_host_blocks == self.num_host_blocks, "a host block is still held"
