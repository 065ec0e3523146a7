"""Incremental detokenization, and the async engine's streams, aborts and error reporting."""

import asyncio
import gc
import time

import pytest

from engine import AsyncLLMEngine, EngineDeadError, InvalidRequestError, SamplingParams
from engine.checkpoint.loader import load_tokenizer
from engine.config import EngineConfig
from engine.detokenizer import Detokenizer, rust_encode
from engine.sequence import Request


@pytest.mark.parametrize("text", ["héllo wörld → 日本語のテキスト 🚀🎉 done", "ascii only, plain words"])
def test_multibyte_characters_split_across_tokens_are_emitted_whole(tiny_llama_dir, text):
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("prefix", add_special_tokens=False)
    seq = Request("r", None, prompt, SamplingParams()).seqs[0]
    detokenizer = Detokenizer(tokenizer)
    pieces = []
    for token_id in ids:
        seq.append_token(token_id, None)
        detokenizer.append_token(seq)
        piece = detokenizer.take_new_text(seq)
        assert "\ufffd" not in piece
        pieces.append(piece)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    if any(ord(ch) > 0x7FF for ch in text):
        # some token ended mid-character and its delta had to wait for the next token
        assert "" in pieces


def test_a_fast_tokenizer_decodes_in_rust_and_gives_what_transformers_gives(tiny_llama_dir):
    """The detokenizer calls the Rust tokenizer's decode where transformers would return it unchanged (no
    clean-up of tokenization spaces), with or without special tokens; a tokenizer that cleans up keeps
    transformers' decode, clean-up included."""
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    assert tokenizer.clean_up_tokenization_spaces is False
    ids = tokenizer.encode("a , b . héllo → 日本 🚀", add_special_tokens=False)
    with_special = [tokenizer.bos_token_id or 1, *ids, tokenizer.eos_token_id or 2]
    detokenizer = Detokenizer(tokenizer)
    assert detokenizer._rust_decode is not None
    for token_ids in (ids, with_special, ids[:1], []):
        for skip in (True, False):
            assert detokenizer.decode(token_ids, skip) == tokenizer.decode(token_ids, skip_special_tokens=skip)

    tokenizer.clean_up_tokenization_spaces = True
    cleaning = Detokenizer(tokenizer)
    assert cleaning._rust_decode is None
    assert cleaning.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_prompts_encode_in_rust_where_it_gives_what_transformers_gives(tiny_llama_dir):
    """A text prompt's ids come from the Rust tokenizer's encode (special tokens added as transformers adds them),
    made once per tokenizer; a tokenizer whose encode differs from it on a probe text, or whose Rust tokenizer has
    truncation set, keeps transformers' encode."""
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    encode = rust_encode(tokenizer)
    assert encode.__name__ == "fast" and rust_encode(tokenizer) is encode
    for text in ("a , b . héllo → 日本 🚀", "  spaces\n\tand tabs", "", tokenizer.eos_token or "</s>"):
        assert encode(text) == list(tokenizer.encode(text))

    other = load_tokenizer(str(tiny_llama_dir))
    plain = other.encode
    other.encode = lambda text, **kwargs: [*plain(text, **kwargs), 7]  # transformers adds something Rust does not
    assert rust_encode(other).__name__ == "slow" and rust_encode(other)("hi") == other.encode("hi")

    truncating = load_tokenizer(str(tiny_llama_dir))
    truncating._tokenizer.enable_truncation(max_length=4)
    assert rust_encode(truncating).__name__ == "slow"


def test_the_loop_warms_the_linears_up_while_idle_and_serves_meanwhile(tiny_llama_dir):
    """The engine loop runs the idle warm-up (oneDNN's primitives for the prefill row buckets) a unit at a time
    while no request runs, until it is done; a request that comes meanwhile is served as any other."""
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16", max_num_batched_tokens=1024))
    try:
        warm_up = engine._engine_loop.engine.executor.runner.linear_warm_up

        async def one():
            return [out async for out in engine.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True),
                                                          "during-warm-up")]

        outs = asyncio.run(one())
        assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 4
        deadline = time.monotonic() + 60
        while engine._engine_loop.warming_up and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for the loop to finish its idle work, not timing it
        assert not engine._engine_loop.warming_up and warm_up.done and warm_up.products > 0
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def async_engine(tiny_llama_dir):
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))
    yield engine
    engine.shutdown()


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def collect(engine, request_id, prompt, params):
    tokens, text, last = [], "", None
    async for delta in engine.generate(prompt, params, request_id):
        for out in delta.outputs:
            tokens.extend(out.token_ids)
            text += out.text
        last = delta
    return tokens, text, last


async def test_concurrent_streams_match_offline_generation(async_engine, hf_greedy, tiny_llama_dir):
    prompts = [[5 + i, 40, 77, 100 + i * 3, 9] * (i + 1) for i in range(6)]
    expected = hf_greedy(tiny_llama_dir, prompts, 10, ignore_eos=True)
    results = await asyncio.gather(
        *(collect(async_engine, f"c{i}", p, greedy(10)) for i, p in enumerate(prompts))
    )
    assert [tokens for tokens, _, _ in results] == expected
    for _, _, last in results:
        assert last.finished and last.outputs[-1].finish_reason == "length"
        metrics = last.metrics
        assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time <= metrics.finished_time


async def test_leaving_a_stream_early_aborts_and_frees_blocks(async_engine):
    idle_free = async_engine.stats().num_free_blocks
    stream = async_engine.generate([3] * 50, greedy(200), "leaver")
    async for _ in stream:
        break
    await stream.aclose()
    for _ in range(200):  # the abort lands on the loop thread within a step
        if async_engine.stats().num_free_blocks == idle_free and async_engine.stats().num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert async_engine.stats().num_free_blocks == idle_free
    assert async_engine.stats().num_running == 0


async def test_invalid_request_raises_before_streaming_and_engine_keeps_serving(async_engine):
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        async for _ in async_engine.generate([1] * 10, greedy(10**6), "too-long"):
            pass
    tokens, _, _ = await collect(async_engine, "after-bad", [4, 5, 6], greedy(3))
    assert len(tokens) == 3


async def test_explicit_abort_ends_the_stream_with_abort(async_engine):
    seen = []
    async for delta in async_engine.generate([8] * 30, greedy(500), "aborted"):
        seen.append(delta)
        if len(seen) == 2:
            async_engine.abort("aborted")
    assert seen[-1].finished and seen[-1].outputs[-1].finish_reason == "abort"


async def test_abort_all_ends_every_open_stream_with_abort_and_frees_their_blocks(async_engine):
    idle_free = async_engine.stats().num_free_blocks
    streams = [async_engine.generate([9 + i] * 20, greedy(500), f"drained-{i}") for i in range(3)]
    firsts = await asyncio.gather(*(anext(s) for s in streams))
    assert not any(first.finished for first in firsts)
    async_engine.abort_all()
    for first, stream in zip(firsts, streams, strict=True):
        deltas = [first] + [delta async for delta in stream]
        assert deltas[-1].finished and deltas[-1].outputs[-1].finish_reason == "abort"
        assert sum(len(out.token_ids) for d in deltas for out in d.outputs) < 500
    assert async_engine.stats().num_free_blocks == idle_free
    tokens, _, _ = await collect(async_engine, "after-abort-all", [4, 5, 6], greedy(3))
    assert len(tokens) == 3


async def test_a_dying_step_loop_fails_every_stream_and_marks_the_engine_dead(tiny_llama_dir):
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))

    def broken_step():
        raise RuntimeError("simulated device failure")

    engine.engine.step = broken_step
    with pytest.raises(EngineDeadError, match="simulated device failure"):
        async for _ in engine.generate([5, 6, 7], greedy(4), "doomed"):
            pass
    assert not engine.is_running
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate([5, 6, 7], greedy(4), "after-death"):
            pass
    engine.shutdown()


def test_the_async_engine_builds_and_steps_on_its_loop_thread_with_the_configured_cpu_threads(
    tiny_llama_dir, monkeypatch
):
    """Under OpenMP a new OS thread starts from OMP_NUM_THREADS (Ray sets it to 1 per replica), so
    the thread count must be set on the loop thread that runs the steps (else a served replica ran on
    one of two cores); and only there: a second OpenMP team on the constructing thread made every op
    of the loop thread twice as slow at batch 1 (engine/async_engine.py)."""
    import threading

    import torch

    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append((threading.get_ident(), n)), real(n)))
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", cpu_threads=1))
    try:

        async def run():
            async for _ in engine.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True), "threads"):
                pass

        asyncio.run(run())
    finally:
        engine.shutdown()
        real(EngineConfig(model=str(tiny_llama_dir)).resolved_cpu_threads())
    threads = {ident for ident, _ in calls}
    assert {n for _, n in calls} == {1}
    assert threads == {engine.loop_thread.ident} != {threading.get_ident()}


def test_cpu_threads_default_to_the_cores_shared_by_the_ranks(tiny_llama_dir):
    import os

    cores = len(os.sched_getaffinity(0))
    assert EngineConfig(model=str(tiny_llama_dir)).resolved_cpu_threads() == cores
    assert EngineConfig(model=str(tiny_llama_dir), tensor_parallel_size=4).resolved_cpu_threads() == max(1, cores // 4)
    assert EngineConfig(model=str(tiny_llama_dir), cpu_threads=3).resolved_cpu_threads() == 3


def test_an_engine_that_cannot_be_built_raises_in_the_constructor_and_leaves_no_loop(tmp_path):
    import threading

    def loops() -> int:
        return sum(t.name == "shardserve-engine-loop" and t.is_alive() for t in threading.enumerate())

    before = loops()
    (tmp_path / "config.json").write_text("{}")  # a directory that is not a model
    with pytest.raises(Exception):  # noqa: B017 — whatever the loader raises reaches the caller
        AsyncLLMEngine(EngineConfig(model=str(tmp_path)))
    assert loops() == before


async def test_shutdown_ends_the_loop_thread_and_every_open_stream_and_can_be_repeated(tiny_llama_dir):
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))
    step = engine.engine.step
    engine.engine.step = lambda: (time.sleep(0.05), step())[1]  # the stream stays open for 50 s
    stream = engine.generate([5, 6, 7], greedy(1000), "open")
    await anext(stream)
    await asyncio.to_thread(engine.shutdown)
    assert not engine.loop_thread.is_alive() and not engine.is_running
    with pytest.raises(EngineDeadError, match="shut down"):
        async for _ in stream:
            pass
    engine.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        async for _ in engine.generate([5, 6, 7], greedy(2), "after"):
            pass


async def test_leaving_an_async_with_block_stops_the_loop_thread(tiny_llama_dir):
    async with AsyncLLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32")) as engine:
        tokens, _, _ = await collect(engine, "inside", [4, 5, 6], greedy(3))
        assert len(tokens) == 3
    assert not engine.loop_thread.is_alive()


def test_a_dropped_async_engine_stops_its_loop_thread(tiny_llama_dir):
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))
    thread = engine.loop_thread
    del engine  # no shutdown(): the loop thread refers to its own state only, so the engine is collected
    gc.collect()
    assert not thread.is_alive()


@pytest.mark.parametrize("interval_s", [0.0, 60.0])
async def test_a_delivery_interval_holds_the_middle_deltas_but_never_the_first_or_the_last(tiny_llama_dir,
                                                                                           interval_s):
    """With an interval longer than the request, its first delta comes at once (the first token: TTFT) and all
    the others together once it has finished; without one, each step's delta comes while it still runs."""
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"), delivery_interval_s=interval_s)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        tokens, running_at_receipt = [], []
        async for delta in engine.generate([5, 6, 7, 8], params, f"held-{interval_s}"):
            tokens += delta.outputs[0].token_ids
            running_at_receipt.append(engine.stats().num_running)
        assert len(tokens) == 200 and len(running_at_receipt) == 200
        if interval_s:
            assert running_at_receipt[0] == 1  # the first token was not held
            assert running_at_receipt[1:] == [0] * 199  # the rest came with the last
        else:
            assert running_at_receipt[1] == 1 and running_at_receipt.count(1) > 100
    finally:
        engine.shutdown()
