"""PrefixIndex: which replica was sent which prompt prefix, keyed by the engine's chained block hashes.

The engine names a full block of `block_size` prompt tokens by a hash chained on the previous block's
hash (engine/prefix_cache.py `hash_block`), so two prompts share hash i only if they agree on every token
of blocks 0..i: a replica that was sent hash i holds, if its prefix cache kept them, all of blocks 0..i,
and the longest run of leading hashes a replica owns is the prefix its cache would hit. The index is the
router's memory of what it sent, not a view of the replicas' caches: approximate by design, and bounded
two ways. An entry unused for `ttl_s` no longer matches and is swept out on the next insert; each replica
keeps at most `max_blocks_per_replica` entries, least recently used dropped first. One insert stamps its
tail blocks as older than its head blocks, so under the cap a shared head outlives the tails, as in the
engine's own eviction order.

Shape: `_owners: {block_hash: {replica: last_used}}` plus, per replica, an `OrderedDict{block_hash:
last_used}` oldest first. insert is O(blocks inserted + blocks evicted); match_lengths is
O(matched_blocks x replicas still matching); remove_replica is O(that replica's blocks). Memory: at most
replicas x max_blocks_per_replica entries. Replicas are any hashable key (Serve's ReplicaID in the
router); time is whatever clock the caller passes as `now` (monotonic seconds).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Sequence
from typing import Generic, TypeVar

Replica = TypeVar("Replica", bound=Hashable)


class PrefixIndex(Generic[Replica]):
    """Block hash -> replicas that were sent it, with TTL ageing and a per-replica LRU cap."""

    def __init__(self, ttl_s: float, max_blocks_per_replica: int):
        if ttl_s <= 0 or max_blocks_per_replica < 1:
            raise ValueError(
                f"need ttl_s > 0 and max_blocks_per_replica >= 1, got {ttl_s}, {max_blocks_per_replica}")
        self.ttl_s = ttl_s
        self.max_blocks_per_replica = max_blocks_per_replica
        self._owners: dict[bytes, dict[Replica, float]] = {}
        self._lru: dict[Replica, OrderedDict[bytes, float]] = {}

    def __len__(self) -> int:
        """Entries held: (block, replica) pairs."""
        return sum(len(lru) for lru in self._lru.values())

    def num_blocks(self, replica: Replica) -> int:
        return len(self._lru.get(replica, ()))

    def num_distinct_blocks(self) -> int:
        """Distinct block hashes held, over all replicas."""
        return len(self._owners)

    def replicas(self) -> set[Replica]:
        return set(self._lru)

    def insert(self, replica: Replica, block_hashes: Sequence[bytes], now: float) -> None:
        """Remember that `replica` was sent a prompt with these leading block hashes, at time `now`."""
        if not block_hashes:
            return
        lru = self._lru.setdefault(replica, OrderedDict())
        # Head last: the head becomes the most recently used, so the cap drops tails first.
        for block_hash in reversed(block_hashes):
            lru[block_hash] = now
            lru.move_to_end(block_hash)
            self._owners.setdefault(block_hash, {})[replica] = now
        while len(lru) > self.max_blocks_per_replica:
            block_hash, _ = lru.popitem(last=False)
            self._forget(block_hash, replica)
        self.evict_expired(now)

    def evict_expired(self, now: float) -> int:
        """Drop every entry unused for more than ttl_s; returns how many went."""
        cutoff = now - self.ttl_s
        evicted = 0
        for replica in list(self._lru):
            lru = self._lru[replica]
            while lru:
                block_hash, last_used = next(iter(lru.items()))
                if last_used >= cutoff:
                    break
                lru.popitem(last=False)
                self._forget(block_hash, replica)
                evicted += 1
            if not lru:
                del self._lru[replica]
        return evicted

    def match_lengths(
        self, block_hashes: Sequence[bytes], now: float, replicas: Collection[Replica] | None = None
    ) -> dict[Replica, int]:
        """Per replica (of `replicas`, default all): leading blocks of the prompt it was sent; 0s left out."""
        cutoff = now - self.ttl_s
        lengths: dict[Replica, int] = {}
        still_matching: list[Replica] | None = None
        for num_matched, block_hash in enumerate(block_hashes, start=1):
            owners = self._owners.get(block_hash)
            if not owners:
                break
            if still_matching is None:
                candidates = owners if replicas is None else (r for r in owners if r in replicas)
            else:
                candidates = still_matching
            still_matching = [r for r in candidates if (used := owners.get(r)) is not None and used >= cutoff]
            if not still_matching:
                break
            for replica in still_matching:
                lengths[replica] = num_matched
        return lengths

    def remove_replica(self, replica: Replica) -> None:
        """Forget everything sent to `replica` (it left the deployment)."""
        for block_hash in self._lru.pop(replica, ()):
            self._forget(block_hash, replica)

    def _forget(self, block_hash: bytes, replica: Replica) -> None:
        owners = self._owners.get(block_hash)
        if owners is None:
            return
        owners.pop(replica, None)
        if not owners:
            del self._owners[block_hash]
