"""Swap preemption: KV blocks copied to a host pool and back, exact outputs, no recompute, no stall."""

import random
import threading

import pytest
import torch
from scheduler_steps import run_step, scheduler_with_fixed_tokens

from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sequence import Request, SequenceStatus
from engine.swap import KVSwapper

TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * 64 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads, head_dim 64, float32


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def random_prompts(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(n)] for n in lengths]


def swap_space_for(num_host_blocks: int) -> float:
    """The swap_space (GiB) that gives the tiny model exactly this many host blocks."""
    return num_host_blocks * TINY_BLOCK_BYTES / 2**30


def make_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("swap_space", swap_space_for(256))
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", preemption_mode="swap", **kw))


def drive(engine, prompts, max_tokens, on_step=None):
    requests = [engine.add_request(str(i), p, greedy(max_tokens)) for i, p in enumerate(prompts)]
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            got.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
        if on_step is not None:
            on_step(engine)
    return [got[str(i)] for i in range(len(prompts))], requests


def computed_prefill_tokens(requests) -> int:
    return sum(n for request in requests for _, n, _ in request.metrics.prefill_chunks)


# ---- scheduler and block manager, exact block ids ----------------------------------------------


def make_scheduler(num_blocks=4, num_host_blocks=8, block_size=4):
    config = EngineConfig(
        model="unused", block_size=block_size, watermark=0.0, preemption_mode="swap", enable_prefix_caching=False
    )
    scheduler = scheduler_with_fixed_tokens(config, num_blocks, num_host_blocks)
    return scheduler, scheduler.block_manager


def add(scheduler, prompt_len, max_tokens=8):
    request = Request(f"s{random.random()}", None, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))
    scheduler.add(request.seqs[0])
    return request.seqs[0]


def live(scheduler):
    return [*scheduler.running, *scheduler.waiting, *scheduler.swapped]


def test_preempted_sequence_is_swapped_out_and_its_blocks_wait_for_the_copy():
    scheduler, manager = make_scheduler()
    old, new = add(scheduler, 8), add(scheduler, 8)  # blocks [0, 1] and [2, 3]
    run_step(scheduler, scheduler.schedule())
    out = scheduler.schedule()  # both need a third block: new is swapped out
    assert out.preempted == [new] and out.swap_out == [(2, 0), (3, 1)] and out.swap_out_ticket is not None
    assert new.status is SequenceStatus.SWAPPED and new.host_block_table == [0, 1] and new.block_table == []
    assert new.num_computed_tokens == 8  # kept: nothing will be recomputed
    # the copy still reads blocks 2 and 3: old waits for them instead of preempting itself
    assert out.is_empty and manager.ref_counts[2:] == [1, 1] and manager.num_free_blocks == 0
    manager.check_invariants(live(scheduler))
    assert scheduler.schedule().is_empty  # the copy has not been reported finished
    scheduler.swap_outs_done([out.swap_out_ticket])
    out = scheduler.schedule()
    assert [c.seq for c in out.decodes] == [old] and old.block_table == [0, 1, 2]
    assert scheduler.num_preemptions_by_mode == {"recompute": 0, "swap": 1}
    manager.check_invariants(live(scheduler))


def test_swapped_sequence_comes_back_before_new_prompts_without_recomputing():
    scheduler, manager = make_scheduler(num_blocks=4)
    old, new = add(scheduler, 8), add(scheduler, 8)
    run_step(scheduler, scheduler.schedule())
    out = scheduler.schedule()
    scheduler.swap_outs_done([out.swap_out_ticket])
    scheduler.finish(old, "length")
    newcomer = add(scheduler, 3)
    out = scheduler.schedule()
    assert out.swap_in == [(0, 0), (1, 1)] and new.block_table == [0, 1, 2]
    assert [c.seq for c in out.decodes] == [new]  # its 9th token only: the 8 before are swapped in
    assert new.status is SequenceStatus.RUNNING and new.host_block_table == []
    assert [c.seq for c in out.prefills] == [newcomer] and newcomer.block_table == [3]
    assert scheduler.running == [new, newcomer]
    assert manager.num_free_host_blocks == 8
    manager.check_invariants(live(scheduler))


def test_no_prompt_is_admitted_while_a_sequence_waits_in_swapped():
    scheduler, manager = make_scheduler(num_blocks=6)
    add(scheduler, 8)
    add(scheduler, 8)
    third = add(scheduler, 8)  # blocks 0-5: the pool is full
    run_step(scheduler, scheduler.schedule())
    out = scheduler.schedule()
    assert out.preempted == [third] and out.swap_out == [(4, 0), (5, 1)]
    scheduler.swap_outs_done([out.swap_out_ticket])
    newcomer = add(scheduler, 1)  # one block would fit, but third has not come back yet
    out = scheduler.schedule()
    assert newcomer.status is SequenceStatus.WAITING and third.status is SequenceStatus.SWAPPED
    manager.check_invariants(live(scheduler))


def test_full_host_pool_falls_back_to_recompute_and_counts_it():
    scheduler, manager = make_scheduler(num_host_blocks=1)
    add(scheduler, 8)
    new = add(scheduler, 8)
    run_step(scheduler, scheduler.schedule())
    out = scheduler.schedule()
    assert out.preempted == [new] and out.swap_out == []
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert scheduler.num_preemptions_by_mode == {"recompute": 1, "swap": 0}
    manager.check_invariants(live(scheduler))


def test_aborting_a_swapped_sequence_returns_its_host_blocks():
    scheduler, manager = make_scheduler()
    add(scheduler, 8)
    new = add(scheduler, 8)
    run_step(scheduler, scheduler.schedule())
    out = scheduler.schedule()
    scheduler.finish(new, "abort")
    assert manager.num_free_host_blocks == 8 and not scheduler.swapped
    scheduler.swap_outs_done([out.swap_out_ticket])
    manager.check_invariants(live(scheduler))


def test_a_step_waits_only_for_the_swap_outs_whose_blocks_it_writes():
    caches = [torch.randn(2, 2, 8, 4, 3) for _ in range(2)]  # [2, kv_heads, blocks, block_size, head_dim]
    swapped_out = [cache[:, :, [2, 5]].clone() for cache in caches]
    swapper = KVSwapper(caches, 4, torch.device("cpu"))
    release = threading.Event()
    swapper.swap_out_hook = lambda: release.wait(timeout=60)
    no_slots = torch.zeros(0, dtype=torch.int64)
    swapper.before_step([(2, 0), (5, 1)], [], 0, no_slots, 4)
    # writing blocks 0 and 1 does not wait for the copy that reads blocks 2 and 5 (it is still held)
    swapper.before_step([], [], None, torch.arange(0, 8), 4)
    assert swapper.num_swap_out_waits == 0 and not swapper.in_flight[0].done()
    # writing a slot of block 5 must wait for that copy: release it only once the step asks
    wait_on = swapper._wait_on
    swapper._wait_on = lambda job: (release.set(), wait_on(job))
    swapper.before_step([], [], None, torch.tensor([5 * 4 + 1]), 4)
    assert swapper.num_swap_out_waits == 1 and swapper.in_flight[0].done()
    assert swapper.poll() == [0] and not swapper.in_flight
    # and the copies come back intact, into other blocks
    swapper.before_step([], [(0, 7), (1, 3)], None, no_slots, 4)
    for cache, expected in zip(caches, swapped_out):
        assert torch.equal(cache[:, :, [7, 3]], expected)
    swapper.shutdown()


def test_the_swap_out_thread_ends_with_the_engine(tiny_llama_dir):
    before = set(threading.enumerate())
    engine = make_engine(tiny_llama_dir, num_kv_blocks=10, max_model_len=160, enable_prefix_caching=False,
                         watermark=0.0)
    drive(engine, random_prompts([30, 30, 30, 30], seed=12), 40)
    assert engine.scheduler.num_preemptions_by_mode["swap"] > 0
    started = [t for t in threading.enumerate() if t not in before and t.name.startswith("kv-swap-out")]
    assert started
    engine.shutdown()
    engine.shutdown()
    assert not any(t.is_alive() for t in started)


def test_a_dropped_swapper_ends_its_thread():
    caches = [torch.randn(2, 2, 8, 4, 3) for _ in range(2)]  # [2, kv_heads, blocks, block_size, head_dim]
    swapper = KVSwapper(caches, 4, torch.device("cpu"))
    before = set(threading.enumerate())
    swapper.before_step([(2, 0)], [], 0, torch.zeros(0, dtype=torch.int64), 4)
    swapper.wait_all()
    (thread,) = [t for t in threading.enumerate() if t not in before]
    del swapper
    thread.join(timeout=10)
    assert not thread.is_alive()


# ---- the engine against transformers -----------------------------------------------------------


@pytest.mark.parametrize("max_num_batched_tokens", [8192, 24], ids=["whole-prompts", "chunked"])
def test_forced_swap_preemption_is_exact_and_recomputes_nothing(tiny_llama_dir, hf_greedy, max_num_batched_tokens):
    prompts = random_prompts([30, 45, 20, 60, 33, 50], seed=5)
    expected = hf_greedy(tiny_llama_dir, prompts, 24, ignore_eos=True)
    engine = make_engine(tiny_llama_dir, num_kv_blocks=16, max_model_len=256, enable_prefix_caching=False,
                         max_num_batched_tokens=max_num_batched_tokens)
    got, requests = drive(engine, prompts, 24)
    assert got == expected
    assert engine.scheduler.num_preemptions_by_mode["swap"] > 0
    assert engine.scheduler.num_preemptions_by_mode["recompute"] == 0
    assert computed_prefill_tokens(requests) == sum(map(len, prompts))  # every resume was a swap-in
    assert engine.executor.runner.swapper.num_swap_out_waits == 0
    engine.scheduler.block_manager.check_all_free()


def test_shared_prefix_with_prefix_caching_and_swap_preemption_is_exact(tiny_llama_dir, hf_greedy):
    rng = random.Random(8)
    prefix = [rng.randrange(3, 1024) for _ in range(300)]
    prompts = [prefix + [rng.randrange(3, 1024) for _ in range(20)] for _ in range(20)]
    shorts = [[rng.randrange(3, 1024) for _ in range(40)] for _ in range(6)]
    for position in (18, 15, 12, 9, 6, 3):  # a short prompt after every third long one
        prompts.insert(position, shorts.pop())
    expected = hf_greedy(tiny_llama_dir, prompts, 8, ignore_eos=True)
    # 40 blocks hold the shared 18 and about 10 requests' own blocks; the 10 host blocks take a
    # short request (3 blocks) but never a long one (21 blocks): those victims are recomputed
    engine = make_engine(tiny_llama_dir, num_kv_blocks=40, max_model_len=512, swap_space=swap_space_for(10))
    num_swapped = []
    got, _ = drive(engine, prompts, 8, on_step=lambda e: num_swapped.append(e.stats().num_swapped))
    assert got == expected
    modes = engine.scheduler.num_preemptions_by_mode
    assert modes["swap"] > 0 and modes["recompute"] > 0, modes
    assert max(num_swapped) >= 1
    assert engine.stats().num_preemptions_by_mode == modes
    assert engine.stats().prefix_cache_hits > 0
    engine.scheduler.block_manager.check_all_free()


def test_decode_steps_continue_while_a_swap_out_is_in_flight(tiny_llama_dir, hf_greedy):
    prompts = random_prompts([30, 30, 30, 30], seed=12)
    expected = hf_greedy(tiny_llama_dir, prompts, 40, ignore_eos=True)
    # 10 blocks hold the four prompts (2 blocks each); at token 32 two of them need a third block
    engine = make_engine(tiny_llama_dir, num_kv_blocks=10, max_model_len=160, enable_prefix_caching=False,
                         watermark=0.0)
    swapper = engine.executor.runner.swapper
    release = threading.Event()
    copy_started = threading.Event()

    def hold_the_copy():
        copy_started.set()
        assert release.wait(timeout=120), "the test never released the swap-out"

    swapper.swap_out_hook = hold_the_copy
    decodes_while_in_flight = []

    def watch(engine):
        if swapper.in_flight and not release.is_set():
            decodes_while_in_flight.append(engine.num_steps)
            if len(decodes_while_in_flight) == 5:
                release.set()

    tokens_before = {}

    def count_tokens(engine):
        if swapper.in_flight and not release.is_set() and not tokens_before:
            tokens_before.update({r: len(req.seqs[0].output_token_ids) for r, req in engine.requests.items()})
        if len(decodes_while_in_flight) == 4:
            progressed = [len(req.seqs[0].output_token_ids) - tokens_before.get(r, 0)
                          for r, req in engine.requests.items() if req.seqs[0].status is SequenceStatus.RUNNING]
            assert max(progressed) >= 3, "no sequence decoded while the swap-out was held"
        watch(engine)

    got, _ = drive(engine, prompts, 40, on_step=count_tokens)
    assert copy_started.is_set() and release.is_set()
    assert len(decodes_while_in_flight) == 5
    assert swapper.num_swap_out_waits == 0  # no step waited on the held copy
    assert got == expected
    engine.scheduler.block_manager.check_all_free()
