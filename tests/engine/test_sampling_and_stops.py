"""Seeded sampling, sampling filters, and every way a sequence can stop."""

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import sample
from engine.sequence import Request
from kernels.backend import get_backend

BACKEND = get_backend()  # what a CPU engine's model runner samples with


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), dtype="float32")


def prompts(n, length=20, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(length)] for _ in range(n)]


def test_a_seeded_request_draws_the_same_tokens_alone_in_a_batch_of_50_after_a_prefix_hit_and_after_preemption(
    tiny_llama_dir,
):
    target = prompts(1, length=40, seed=1)[0]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", enable_prefix_caching=True)
    alone = llm.generate([target], params)[0].outputs[0].token_ids
    assert len(set(alone)) > 8  # a real random walk, not a collapsed one

    # a prefix-cache hit: the prompt's full blocks are already cached by the run above
    again = llm.generate([target], params)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == alone

    # in a batch of 50 with unseeded sampled neighbours of other lengths
    others = prompts(49, length=33, seed=2)
    neighbours = [SamplingParams(temperature=0.8, top_k=40, max_tokens=10, ignore_eos=True)] * 49
    in_batch = llm.generate(others[:20] + [target] + others[20:], neighbours[:20] + [params] + neighbours[20:])
    assert in_batch[20].outputs[0].token_ids == alone

    # preempted and recomputed: 12 blocks of 16 tokens for six 40-token prompts growing by 24 (the
    # fourth admitted is the one the pool runs short on)
    small = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=12, max_model_len=128)
    crowd = prompts(5, length=40, seed=3)
    unseeded = [params.model_copy(update={"seed": None})] * 5
    under_pressure = small.generate(crowd[:3] + [target] + crowd[3:], unseeded[:3] + [params] + unseeded[3:])
    assert under_pressure[3].metrics.preemptions, "the pool was large enough: the request was never preempted"
    assert under_pressure[3].outputs[0].token_ids == alone

    different_seed = params.model_copy(update={"seed": 99})
    assert llm.generate([target], different_seed)[0].outputs[0].token_ids != alone


def test_unseeded_requests_draw_from_fresh_entropy(llm):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    first, second = llm.generate([prompts(1)[0]] * 2, params)
    assert first.outputs[0].token_ids != second.outputs[0].token_ids


def test_n_choices_with_a_seed_differ_from_each_other_and_repeat_across_runs(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    first = [c.token_ids for c in llm.generate(prompts(1)[0], params)[0].outputs]
    second = [c.token_ids for c in llm.generate(prompts(1)[0], params)[0].outputs]
    assert first == second
    assert len({tuple(t) for t in first}) == 3


def _seq_with(params, tokens=(5, 6, 7)):
    return Request("r", None, list(tokens), params).seqs[0]


def test_top_k_one_and_temperature_zero_are_greedy():
    logits = torch.randn(2, 50)
    seqs = [_seq_with(SamplingParams(top_k=1, temperature=1.0)), _seq_with(SamplingParams(temperature=0.0))]
    assert [t.token_id for t in sample(logits, seqs, (), BACKEND)] == logits.argmax(-1).tolist()


def test_top_k_and_top_p_never_pick_outside_their_set():
    torch.manual_seed(0)
    logits = torch.randn(1, 100)
    top5 = set(logits[0].topk(5).indices.tolist())
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    for _ in range(50):
        [k] = sample(logits, [_seq_with(SamplingParams(top_k=5))], (), BACKEND)
        [p] = sample(logits, [_seq_with(SamplingParams(top_p=0.5))], (), BACKEND)
        assert k.token_id in top5
        assert p.token_id in nucleus


def test_min_p_drops_unlikely_tokens():
    logits = torch.full((1, 10), -10.0)
    logits[0, 3], logits[0, 4] = 5.0, 4.5
    for _ in range(30):
        [t] = sample(logits, [_seq_with(SamplingParams(min_p=0.1))], (), BACKEND)
        assert t.token_id in (3, 4)


def test_repetition_and_presence_penalties_steer_away_from_seen_tokens():
    logits = torch.zeros(1, 10)
    logits[0, 5] = 1.0  # token 5 is in the prompt and would win greedily
    logits[0, 8] = 0.9
    penalised = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample(logits, [_seq_with(penalised)], (), BACKEND)[0].token_id == 8
    seq = _seq_with(SamplingParams(temperature=0.0, presence_penalty=0.5), tokens=(1,))
    seq.append_token(5, None)  # an output token
    assert sample(logits, [seq], (), BACKEND)[0].token_id == 8


def test_min_tokens_suppresses_eos():
    logits = torch.zeros(1, 10)
    logits[0, 2] = 10.0  # EOS is by far the best token
    seq = _seq_with(SamplingParams(temperature=0.0, min_tokens=2))
    assert sample(logits, [seq], (2,), BACKEND)[0].token_id != 2


@pytest.fixture(scope="module")
def engine(llm):
    return llm.engine


def run(engine, prompt, params):
    """One request through the engine to completion; its accumulated output."""
    request_id = f"req-{random.randrange(10**9)}"
    engine.add_request(request_id, prompt, params)
    result = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if result is None:
                result = delta
            else:
                result.merge(delta)
    return result.outputs[0]


def test_max_tokens_ends_with_length(engine):
    out = run(engine, prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_token_id_ends_the_sequence_and_is_not_in_text(engine):
    prompt = prompts(1, seed=4)[0]
    free = run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    stop_id = free.token_ids[3]
    out = run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_id]))
    first = free.token_ids.index(stop_id)
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.text == engine.tokenizer.decode(free.token_ids[:first], skip_special_tokens=True)


def test_eos_stops_unless_ignore_eos(engine):
    prompt = prompts(1, seed=5)[0]
    free = run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    # declare the 3rd greedy token an EOS token for this engine
    stop_checker = engine.scheduler.stop_checker
    saved = stop_checker.eos_token_ids
    stop_checker.eos_token_ids = (free.token_ids[2],)
    try:
        stopped = run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=6))
        ignored = run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    finally:
        stop_checker.eos_token_ids = saved
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(free.token_ids[2]) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_stop_string_truncates_text_and_is_not_emitted(engine):
    prompt = prompts(1, seed=6)[0]
    free = run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert len(free.text) > 6
    stop = free.text[4:6]
    out = run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[: free.text.index(stop)]
    assert stop not in out.text


def test_streamed_deltas_concatenate_to_the_full_text_and_hold_back_stop_prefixes(engine):
    prompt = prompts(1, seed=8)[0]
    free = run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    stop = free.text[-3:]  # only completes at the very end
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    engine.add_request("stream", prompt, params)
    pieces = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            pieces.extend(o.text for o in delta.outputs)
            assert stop not in "".join(pieces)
    assert "".join(pieces) == free.text[: free.text.index(stop)]
