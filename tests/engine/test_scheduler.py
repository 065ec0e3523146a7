"""Scheduler and block manager: exact block ids, token budgets, chunking, preemption."""

import pytest
from scheduler_steps import run_step, scheduler_with_fixed_tokens

from engine.block_manager import BlockManager
from engine.config import EngineConfig, SamplingParams
from engine.sampler import SampledToken
from engine.sequence import Request, SequenceStatus


def make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64, max_num_seqs=8, chunked=True):
    config = EngineConfig(
        model="unused",
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=False,
        watermark=0.0,
    )
    scheduler = scheduler_with_fixed_tokens(config, num_blocks)
    return scheduler, scheduler.block_manager


_request_counter = iter(range(10**6))


def add_request(scheduler, prompt_len, max_tokens=8):
    request = Request(f"r{next(_request_counter)}", None, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))
    for seq in request.seqs:
        scheduler.add(seq)
    return request.seqs[0]


def test_prompt_blocks_are_allocated_in_order_from_the_free_pool():
    scheduler, manager = make_scheduler()
    a = add_request(scheduler, 6)  # 2 blocks of 4
    b = add_request(scheduler, 9)  # 3 blocks
    out = scheduler.schedule()
    assert [c.seq for c in out.prefills] == [a, b]
    assert a.block_table == [0, 1]
    assert b.block_table == [2, 3, 4]
    assert manager.num_free_blocks == 11


def test_blocks_released_tail_first_come_back_to_a_new_prompt_in_address_order():
    # the free queue returns a finished sequence's blocks tail first (its eviction order); a prompt that takes
    # them gets them ascending, the order decode attention reads fastest
    manager = BlockManager(8, 4, watermark=0.0, enable_prefix_caching=True)
    first = Request("first", None, list(range(100, 116)), SamplingParams()).seqs[0]
    assert manager.allocate_slots(first, 16)
    first.num_computed_tokens = 16
    manager.free(first)
    assert list(manager.free_queue)[-4:] == [3, 2, 1, 0]
    taker = Request("taker", None, list(range(200, 232)), SamplingParams()).seqs[0]
    assert manager.allocate_slots(taker, 32)
    assert taker.block_table == list(range(8))
    assert manager.num_evictions == 4
    manager.check_invariants([taker])


def test_decode_appends_a_block_only_when_the_last_one_fills():
    scheduler, manager = make_scheduler()
    seq = add_request(scheduler, 7)
    run_step(scheduler, scheduler.schedule())  # prompt: 7 tokens in blocks [0, 1]; sampled token 8
    assert seq.num_tokens == 8 and seq.block_table == [0, 1]
    out = scheduler.schedule()  # decode token 8 -> position 7, still block 1
    assert [c.seq for c in out.decodes] == [seq] and seq.block_table == [0, 1]
    run_step(scheduler, out)
    out = scheduler.schedule()  # token 9 -> position 8, needs block 2
    assert seq.block_table == [0, 1, 2]


def test_decode_is_scheduled_before_new_prefill():
    scheduler, _ = make_scheduler(max_num_batched_tokens=10)
    first = add_request(scheduler, 4)
    run_step(scheduler, scheduler.schedule())
    second = add_request(scheduler, 20)
    out = scheduler.schedule()
    assert [c.seq for c in out.decodes] == [first]
    # the remaining 9 tokens of budget go to the new prompt's first chunk
    assert [(c.seq, c.num_tokens) for c in out.prefills] == [(second, 9)]
    assert out.num_batched_tokens == 10


def test_long_prompt_is_split_across_steps_within_the_budget():
    scheduler, _ = make_scheduler(max_num_batched_tokens=8, num_blocks=32)
    seq = add_request(scheduler, 20)
    chunks = []
    while seq.num_output_tokens == 0:
        out = scheduler.schedule()
        chunks.append(out.prefills[0].num_tokens)
        assert out.num_batched_tokens <= 8
        run_step(scheduler, out)
    assert chunks == [8, 8, 4]
    assert seq.block_table == [0, 1, 2, 3, 4]


def test_without_chunked_prefill_a_prompt_over_the_budget_waits():
    scheduler, _ = make_scheduler(max_num_batched_tokens=8, chunked=False)
    add_request(scheduler, 12)
    assert scheduler.schedule().is_empty


def test_max_num_seqs_caps_running_sequences():
    scheduler, _ = make_scheduler(max_num_seqs=2)
    seqs = [add_request(scheduler, 2) for _ in range(3)]
    out = scheduler.schedule()
    assert [c.seq for c in out.prefills] == seqs[:2]
    assert list(scheduler.waiting) == [seqs[2]]


def test_newest_running_sequence_is_preempted_when_blocks_run_out():
    scheduler, manager = make_scheduler(num_blocks=4, block_size=4)
    old = add_request(scheduler, 8)  # blocks 0, 1
    new = add_request(scheduler, 8)  # blocks 2, 3
    run_step(scheduler, scheduler.schedule())
    assert manager.num_free_blocks == 0
    out = scheduler.schedule()  # both need a third block; only preempting `new` frees two
    assert out.preempted == [new]
    assert [c.seq for c in out.decodes] == [old]
    assert old.block_table == [0, 1, 2]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0 and new.block_table == []
    assert list(scheduler.waiting) == [new]
    assert scheduler.num_preemptions == 1
    assert new.request.metrics.preemptions
    manager.check_invariants()


def test_preempted_sequence_is_recomputed_with_its_generated_tokens():
    scheduler, manager = make_scheduler(num_blocks=4, block_size=4)
    old = add_request(scheduler, 8)
    new = add_request(scheduler, 8)
    run_step(scheduler, scheduler.schedule())
    scheduler.schedule()  # preempts `new`, which had 8 prompt tokens + 1 generated
    scheduler.finish(old, "length")
    out = scheduler.schedule()
    assert [(c.seq, c.num_tokens) for c in out.prefills] == [(new, 9)]
    assert new.request.metrics.resumes
    manager.check_invariants()


def test_sequence_preempts_itself_when_it_is_the_newest():
    scheduler, manager = make_scheduler(num_blocks=2, block_size=4)
    seq = add_request(scheduler, 8)
    run_step(scheduler, scheduler.schedule())
    out = scheduler.schedule()  # needs a third block; nothing else to preempt
    assert out.preempted == [seq] and out.is_empty
    assert manager.num_free_blocks == 2


def test_finish_returns_blocks_to_the_pool():
    scheduler, manager = make_scheduler()
    seq = add_request(scheduler, 10)
    scheduler.schedule()
    scheduler.finish(seq, "abort")
    assert manager.num_free_blocks == 16 and seq.block_table == [] and seq.is_finished
    assert not scheduler.has_unfinished()
    manager.check_invariants()


def test_watermark_keeps_blocks_for_running_sequences():
    config = EngineConfig(model="unused", block_size=4, watermark=0.25, enable_prefix_caching=False)
    scheduler = scheduler_with_fixed_tokens(config, 8)  # 2 of the 8 blocks reserved when admitting
    running = add_request(scheduler, 16)  # 4 blocks: admitted with nothing running
    scheduler.schedule()
    waiting = add_request(scheduler, 12)  # 3 blocks: 3 + 2 reserved > 4 free
    out = scheduler.schedule()
    assert [c.seq for c in out.chunks] == [running]
    assert list(scheduler.waiting) == [waiting]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_block_count_covers_exactly_the_computed_tokens(block_size):
    manager = BlockManager(64, block_size, watermark=0.0)
    request = Request("x", None, list(range(37)), SamplingParams())
    seq = request.seqs[0]
    assert manager.allocate_slots(seq, 37)
    assert len(seq.block_table) == -(-37 // block_size)


def test_update_from_output_advances_chunks_and_appends_a_token_only_to_completed_sequences():
    scheduler, _ = make_scheduler(max_num_batched_tokens=10)
    short, long = add_request(scheduler, 4), add_request(scheduler, 12)
    out = scheduler.schedule()  # short whole (4), long's first 6 tokens
    assert out.sampled_seqs == [short]
    assert scheduler.update_from_output(out, [SampledToken(42, None)]) == [short]
    assert short.token_ids[-1] == 42 and short.num_computed_tokens == 4
    assert long.num_computed_tokens == 6 and long.num_output_tokens == 0


def test_a_sequence_that_reaches_max_tokens_is_finished_by_the_scheduler_and_frees_its_blocks():
    scheduler, manager = make_scheduler()
    seq = add_request(scheduler, 4, max_tokens=2)
    run_step(scheduler, scheduler.schedule())
    assert not seq.is_finished
    run_step(scheduler, scheduler.schedule())
    assert seq.is_finished and seq.finish_reason == "length" and seq.output_token_ids == [7, 7]
    assert not scheduler.has_unfinished() and manager.num_free_blocks == manager.num_blocks
    manager.check_invariants()


def test_a_requested_stop_token_finishes_the_sequence_with_that_token_as_stop_reason():
    scheduler, _ = make_scheduler()
    request = Request("stop", None, [1, 2, 3], SamplingParams(max_tokens=8, stop_token_ids=[9]))
    scheduler.add(request.seqs[0])
    run_step(scheduler, scheduler.schedule(), new_token=9)
    seq = request.seqs[0]
    assert (seq.finish_reason, seq.stop_reason) == ("stop", 9)


def test_update_from_output_refuses_a_token_count_that_does_not_match_the_sampled_sequences():
    scheduler, _ = make_scheduler()
    add_request(scheduler, 4)
    out = scheduler.schedule()
    with pytest.raises(ValueError, match="0 sampled tokens for 1 sequences"):
        scheduler.update_from_output(out, [])
