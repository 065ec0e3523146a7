"""PrefixIndex (app/routing/prefix_index.py): each replica's matched prefix by the engine's chained block
hashes, ageing by TTL on an injected clock, a per-replica LRU cap, and replicas leaving."""

from __future__ import annotations

import random

import pytest

from app.routing.block_hashes import prompt_block_hashes
from app.routing.prefix_index import PrefixIndex
from engine.config import SamplingParams
from engine.prefix_cache import full_block_hashes
from engine.sequence import Request

BLOCK = 4
SYSTEM = list(range(100, 112))  # three full blocks shared by every "chat" below


def hashes(token_ids: list[int]) -> tuple[bytes, ...]:
    return prompt_block_hashes(token_ids, BLOCK)


def test_prompt_block_hashes_are_the_engines_own_prefix_cache_names():
    prompt = list(range(37))
    seq = Request("r", None, prompt, SamplingParams()).seqs[0]
    assert list(hashes(prompt)) == full_block_hashes(seq, BLOCK)
    assert len(hashes(prompt)) == 9  # the 1-token tail is not a full block: no hash


def test_a_block_is_named_by_its_whole_history_not_its_own_tokens():
    tail = [7, 7, 7, 7]
    a, b = hashes([1, 2, 3, 4] + tail), hashes([5, 6, 7, 8] + tail)
    assert a[1] != b[1]
    index = PrefixIndex(ttl_s=60, max_blocks_per_replica=100)
    index.insert("r0", a, now=0)
    assert index.match_lengths(b, now=0) == {}


def test_each_replica_matches_the_leading_blocks_it_was_sent():
    index = PrefixIndex(ttl_s=60, max_blocks_per_replica=100)
    index.insert("short", hashes(SYSTEM[:4]), now=0)
    index.insert("long", hashes(SYSTEM + [1, 2, 3, 4]), now=0)
    query = hashes(SYSTEM + [9, 9, 9, 9])
    assert index.match_lengths(query, now=1) == {"short": 1, "long": 3}


def test_a_different_first_block_matches_nothing_even_if_later_hashes_are_known():
    index = PrefixIndex(ttl_s=60, max_blocks_per_replica=100)
    known = hashes(SYSTEM)
    index.insert("r0", known, now=0)
    assert index.match_lengths((b"other first block", *known[1:]), now=0) == {}


def test_match_considers_only_the_replicas_asked_about():
    index = PrefixIndex(ttl_s=60, max_blocks_per_replica=100)
    index.insert("r0", hashes(SYSTEM), now=0)
    index.insert("r1", hashes(SYSTEM[:8]), now=0)
    assert index.match_lengths(hashes(SYSTEM), now=0, replicas={"r1", "r2"}) == {"r1": 2}


def test_a_prefix_sent_to_two_replicas_matches_both_each_until_its_own_ttl():
    index = PrefixIndex(ttl_s=60, max_blocks_per_replica=100)
    index.insert("r0", hashes(SYSTEM), now=0)
    index.insert("r1", hashes(SYSTEM), now=5)
    assert index.match_lengths(hashes(SYSTEM), now=6) == {"r0": 3, "r1": 3}  # the router breaks ties by load
    assert index.match_lengths(hashes(SYSTEM), now=61) == {"r1": 3}


def test_entries_stop_matching_after_the_ttl_and_are_swept_on_the_next_insert():
    index = PrefixIndex(ttl_s=10, max_blocks_per_replica=100)
    index.insert("r0", hashes(SYSTEM), now=0)
    assert index.match_lengths(hashes(SYSTEM), now=10) == {"r0": 3}
    assert index.match_lengths(hashes(SYSTEM), now=10.5) == {}
    assert len(index) == 3  # still held until something sweeps
    index.insert("r1", hashes([1, 2, 3, 4]), now=11)
    assert len(index) == 1 and index.replicas() == {"r1"}
    assert index.num_distinct_blocks() == 1


def test_using_a_prefix_again_restarts_its_ttl():
    index = PrefixIndex(ttl_s=10, max_blocks_per_replica=100)
    index.insert("r0", hashes(SYSTEM), now=0)
    index.insert("r0", hashes(SYSTEM[:8]), now=8)  # a shorter prompt refreshes blocks 0 and 1 only
    assert index.match_lengths(hashes(SYSTEM), now=15) == {"r0": 2}
    assert index.evict_expired(now=15) == 1


def test_the_per_replica_cap_drops_the_least_recently_used_blocks_tails_first():
    index = PrefixIndex(ttl_s=60, max_blocks_per_replica=4)
    index.insert("r0", hashes(SYSTEM), now=0)  # blocks s0 s1 s2
    index.insert("r0", hashes([1, 2, 3, 4, 5, 6, 7, 8]), now=1)  # two more: one must go
    assert index.num_blocks("r0") == 4
    assert index.match_lengths(hashes(SYSTEM), now=2) == {"r0": 2}  # the tail s2 went, not the head s0
    index.insert("r1", hashes(SYSTEM), now=2)  # another replica's blocks do not count against r0's cap
    assert index.num_blocks("r0") == 4 and index.num_blocks("r1") == 3


def test_a_prompt_longer_than_the_cap_keeps_its_head():
    index = PrefixIndex(ttl_s=60, max_blocks_per_replica=2)
    index.insert("r0", hashes(SYSTEM), now=0)
    assert index.match_lengths(hashes(SYSTEM), now=0) == {"r0": 2}


def test_removing_a_replica_forgets_everything_it_was_sent_and_nothing_else():
    index = PrefixIndex(ttl_s=60, max_blocks_per_replica=100)
    index.insert("r0", hashes(SYSTEM), now=0)
    index.insert("r1", hashes(SYSTEM[:4] + [1, 2, 3, 4]), now=0)
    index.remove_replica("r0")
    assert index.match_lengths(hashes(SYSTEM), now=0) == {"r1": 1}
    assert index.replicas() == {"r1"} and len(index) == 2 and index.num_distinct_blocks() == 2
    index.remove_replica("never-seen")  # a no-op


def test_size_stays_bounded_by_replicas_times_the_cap():
    rng = random.Random(0)
    index = PrefixIndex(ttl_s=1e9, max_blocks_per_replica=50)
    for step in range(2000):
        prompt = SYSTEM + [rng.randrange(1000) for _ in range(rng.randrange(0, 40))]
        index.insert(f"r{step % 3}", hashes(prompt), now=step)
    assert len(index) <= 3 * 50
    assert index.num_distinct_blocks() <= 3 * 50
    # the shared system prompt, used by every request, is never what the cap drops
    assert index.match_lengths(hashes(SYSTEM), now=2000) == {"r0": 3, "r1": 3, "r2": 3}


def test_settings_out_of_range_are_refused():
    with pytest.raises(ValueError):
        PrefixIndex(ttl_s=0, max_blocks_per_replica=10)
    with pytest.raises(ValueError):
        PrefixIndex(ttl_s=1, max_blocks_per_replica=0)
