"""Prefix caching: full blocks shared by chained hash, exact outputs, counted savings, eviction order."""

import argparse
import random

import pytest
from scheduler_steps import run_step, scheduler_with_fixed_tokens

from app.cli import add_serve_flags, serve_args_from
from app.config import ServeArgs
from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.prefix_cache import hash_block
from engine.sequence import Request

SHARED, UNIQUE, MAX_NEW = 300, 20, 8
BLOCK = 16


def greedy(max_tokens=MAX_NEW):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def shared_prefix_prompts(num=20, shared=SHARED, unique=UNIQUE, seed=8):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 1024) for _ in range(shared)]
    return [prefix + [rng.randrange(3, 1024) for _ in range(unique)] for _ in range(num)]


def computed_prefill_tokens(requests) -> int:
    """Prompt (and recomputed) tokens the engine actually ran through the model."""
    return sum(n for request in requests for _, n, _ in request.metrics.prefill_chunks)


def run_at_once(engine, prompts):
    requests = [engine.add_request(str(i), p, greedy()) for i, p in enumerate(prompts)]
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            got.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    return [got[str(i)] for i in range(len(prompts))], requests


def run_staggered(engine, prompts, every=2):
    """One new request every `every` steps while the earlier ones decode."""
    requests, got, pending = [], {}, list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending and engine.num_steps % every == 0:
            index, prompt = pending.pop(0)
            requests.append(engine.add_request(str(index), prompt, greedy()))
        for delta in engine.step():
            got.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    return [got[str(i)] for i in range(len(prompts))], requests


def make_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 512)
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", block_size=BLOCK, **kw))


# ---- block manager and scheduler, exact block ids ----------------------------------------------


def make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64):
    config = EngineConfig(model="unused", block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                          watermark=0.0, enable_prefix_caching=True)
    scheduler = scheduler_with_fixed_tokens(config, num_blocks)
    return scheduler, scheduler.block_manager


_ids = iter(range(10**6))


def add(scheduler, tokens, max_tokens=4):
    request = Request(f"p{next(_ids)}", None, tokens, SamplingParams(max_tokens=max_tokens))
    scheduler.add(request.seqs[0])
    return request.seqs[0]


def test_block_hash_names_the_tokens_and_the_whole_history():
    first = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) == first
    assert hash_block(None, [1, 2, 3, 5]) != first
    # the same four tokens after a different parent are a different block
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6, 7, 8])


def test_new_request_starts_after_its_longest_cached_prefix():
    scheduler, manager = make_scheduler()
    a = add(scheduler, list(range(1, 11)))  # 10 tokens: full blocks 0, 1 and a partial block 2
    run_step(scheduler, scheduler.schedule())
    b = add(scheduler, list(range(1, 9)) + [50, 51, 52])  # shares a's first 8 tokens
    out = scheduler.schedule()
    assert b.block_table[:2] == [0, 1] and manager.ref_counts[0] == manager.ref_counts[1] == 2
    assert b.num_cached_tokens == 8
    # b's prefill runs from token 8 on, into a block of its own (a's partial block 2 is never shared)
    assert [(c.seq, c.num_tokens) for c in out.prefills] == [(b, 3)]
    assert b.block_table == [0, 1, 3]
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (10 + 11, 8)
    manager.check_invariants([a, b])


def test_last_prompt_token_is_always_computed():
    scheduler, manager = make_scheduler()
    add(scheduler, list(range(1, 9)) + [60])
    run_step(scheduler, scheduler.schedule())
    twin = add(scheduler, list(range(1, 9)))  # exactly the two cached full blocks
    out = scheduler.schedule()
    # only the first block is reused: the last token must run to give the first output's logits
    assert twin.block_table[0] == 0 and twin.num_computed_tokens == 4
    assert [(c.seq, c.num_tokens) for c in out.prefills] == [(twin, 4)]


def test_same_step_admissions_share_the_blocks_the_step_computes():
    scheduler, manager = make_scheduler()
    first = add(scheduler, list(range(1, 13)))
    second = add(scheduler, list(range(1, 13)))
    out = scheduler.schedule()
    assert [(c.seq, c.num_tokens) for c in out.prefills] == [(first, 12), (second, 4)]
    assert second.block_table == [0, 1, 3]


def test_freed_blocks_are_evicted_unnamed_first_then_lru_sequence_tail_before_head():
    manager = BlockManager(8, 4, watermark=0.0, enable_prefix_caching=True)
    old = Request("old", None, list(range(100, 112)), SamplingParams()).seqs[0]
    new = Request("new", None, list(range(200, 212)), SamplingParams()).seqs[0]
    scratch = Request("scratch", None, [1, 2], SamplingParams()).seqs[0]
    for seq in (old, new, scratch):
        assert manager.allocate_slots(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
    assert (old.block_table, new.block_table, scratch.block_table) == ([0, 1, 2], [3, 4, 5], [6])
    manager.free(old)
    manager.free(new)
    manager.free(scratch)  # a partial block: nothing to reuse
    assert manager.num_free_blocks == 8 and manager.usage == 0.0
    assert list(manager.free_queue) == [6, 7, 2, 1, 0, 5, 4, 3]
    taker = Request("taker", None, list(range(500, 520)), SamplingParams()).seqs[0]
    assert manager.allocate_slots(taker, 20)  # five blocks: the two unnamed ones, then old's tail first
    assert taker.block_table == [0, 1, 2, 6, 7]  # those five, in address order (test_scheduler.py)
    assert manager.num_evictions == 3
    # new's blocks survived: its prompt still finds all three
    again = Request("again", None, list(range(200, 212)) + [9], SamplingParams()).seqs[0]
    assert manager.cached_prefix(again) == [3, 4, 5]
    manager.check_invariants([taker])


def test_a_hit_revives_a_cached_free_block_and_moves_it_to_the_back_when_freed_again():
    manager = BlockManager(4, 4, watermark=0.0, enable_prefix_caching=True)
    first = Request("a", None, list(range(1, 10)), SamplingParams()).seqs[0]
    assert manager.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    manager.free(first)
    assert list(manager.free_queue) == [2, 3, 1, 0]
    second = Request("b", None, list(range(1, 5)) + [99], SamplingParams()).seqs[0]
    hits = manager.cached_prefix(second)
    assert hits == [0]
    assert manager.allocate_slots(second, 1, cached=hits)
    assert second.block_table == [0, 2] and manager.usage == 0.5  # cached-free blocks are not "used"
    second.num_computed_tokens = 5
    manager.free(second)
    assert list(manager.free_queue) == [2, 3, 1, 0]
    manager.check_all_free()


# ---- the engine against transformers -----------------------------------------------------------


@pytest.fixture(scope="module")
def shared_prompts():
    return shared_prefix_prompts()


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, hf_greedy, shared_prompts):
    return hf_greedy(tiny_llama_dir, shared_prompts, MAX_NEW, ignore_eos=True)


def test_shared_prefix_sent_at_once_is_exact_and_computes_the_prefix_once(tiny_llama_dir, shared_prompts, expected):
    off = make_engine(tiny_llama_dir, enable_prefix_caching=False)
    got_off, requests_off = run_at_once(off, shared_prompts)
    on = make_engine(tiny_llama_dir)
    got_on, requests_on = run_at_once(on, shared_prompts)
    assert got_off == expected and got_on == expected

    prompt_len = SHARED + UNIQUE
    shared_blocks = SHARED // BLOCK  # 18 full blocks; the prefix's partial block holds unique tokens too
    own_tokens = prompt_len - shared_blocks * BLOCK
    assert computed_prefill_tokens(requests_off) == 20 * prompt_len  # 6400
    assert computed_prefill_tokens(requests_on) == prompt_len + 19 * own_tokens  # 320 + 19 * 32 = 928
    blocks_per_request = -(-(prompt_len + MAX_NEW) // BLOCK)  # 21
    assert off.scheduler.block_manager.peak_num_used_blocks == 20 * blocks_per_request  # 420
    assert on.scheduler.block_manager.peak_num_used_blocks == shared_blocks + 20 * (blocks_per_request - shared_blocks)  # 78
    assert [r.seqs[0].num_cached_tokens for r in requests_on] == [0] + [shared_blocks * BLOCK] * 19
    stats = on.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20 * prompt_len, 19 * shared_blocks * BLOCK)
    for engine in (off, on):
        engine.scheduler.block_manager.check_all_free()


def test_shared_prefix_staggered_is_exact_and_computes_the_prefix_once(tiny_llama_dir, shared_prompts, expected):
    on = make_engine(tiny_llama_dir)
    got, requests = run_staggered(on, shared_prompts)
    assert got == expected
    own_tokens = SHARED + UNIQUE - (SHARED // BLOCK) * BLOCK
    assert computed_prefill_tokens(requests) == SHARED + UNIQUE + 19 * own_tokens
    assert on.scheduler.block_manager.peak_num_used_blocks <= SHARED // BLOCK + 20 * 3
    on.scheduler.block_manager.check_all_free()


def test_prefix_caching_with_chunked_prefill_and_recompute_preemption(tiny_llama_dir, shared_prompts, expected):
    # 60 blocks hold the 18 shared blocks and about 14 requests' own blocks: preemption must happen
    engine = make_engine(tiny_llama_dir, num_kv_blocks=60, max_model_len=512, max_num_batched_tokens=96)
    got, requests = run_at_once(engine, shared_prompts)
    assert got == expected
    assert engine.scheduler.num_preemptions_by_mode["recompute"] > 0
    assert any(len(r.metrics.prefill_chunks) > 1 for r in requests), "no prompt was chunked"
    engine.scheduler.block_manager.check_all_free()


def test_a_full_pool_of_cached_blocks_is_evicted_in_order_and_stays_exact(tiny_llama_dir, hf_greedy):
    rng = random.Random(4)
    first, second, big, other = ([rng.randrange(3, 1024) for _ in range(n)] for n in (64, 64, 200, 120))
    engine = make_engine(tiny_llama_dir, num_kv_blocks=24, max_model_len=384, watermark=0.0)
    manager = engine.scheduler.block_manager
    outputs = {}
    for name, prompt in (("first", first), ("second", second), ("big", big)):
        outputs[name] = run_at_once(engine, [prompt])[0][0]
    # first took blocks 0-4 (0-3 full and named; 4 holds outputs only), second 4-8 (4-7 named),
    # big 8-20 (8-19 named): unnamed blocks go first, then each request's blocks tail first
    assert manager.num_evictions == 0 and manager.num_free_blocks == 24
    assert list(manager.free_queue) == [20, 21, 22, 23, 3, 2, 1, 0, 7, 6, 5, 4, *range(19, 7, -1)]
    engine.add_request("other", other, greedy())  # 120 + 8 tokens: 8 blocks, 4 of them evicted
    outputs["other"] = engine.step()[0].outputs[0].token_ids
    assert engine.requests["other"].seqs[0].block_table == [0, 1, 2, 3, 20, 21, 22, 23]  # in address order
    assert manager.num_evictions == 4
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs["other"] += delta.outputs[0].token_ids
    # first's prefix is gone, second's survived: a rerun of second computes only its last block
    assert manager.cached_prefix(Request("x", None, first, greedy()).seqs[0]) == []
    rerun_output, [rerun] = run_at_once(engine, [second])
    assert rerun.seqs[0].num_cached_tokens == 48
    expected = hf_greedy(tiny_llama_dir, [first, second, big, other], MAX_NEW, ignore_eos=True)
    assert [outputs[k] for k in ("first", "second", "big", "other")] == expected
    assert rerun_output == [expected[1]]
    manager.check_all_free()


def test_prefix_caching_is_on_by_default_and_the_cli_turns_it_off():
    assert EngineConfig(model="m").enable_prefix_caching
    assert ServeArgs().engine_config("m").enable_prefix_caching
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    assert serve_args_from(parser.parse_args([])).enable_prefix_caching
    args = serve_args_from(parser.parse_args(["--no-enable-prefix-caching"]))
    assert args.engine_config("m").enable_prefix_caching is False


def test_llm_reports_cached_tokens_on_outputs(tiny_llama_dir, shared_prompts):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32")
    llm.generate(shared_prompts[:1], greedy(2))
    [output] = llm.generate(shared_prompts[1:2], greedy(2))
    assert output.num_cached_tokens == (SHARED // BLOCK) * BLOCK
