"""Greedy output equals transformers' token for token, whatever the batching, chunking or preemption."""

import os
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.cpu_binding import allowed_cores
from engine.llm_engine import LLMEngine
from kernels import cpu_native
from kernels.backend import engine_cpu_backend
from tests.engine.test_cpu_binding import on_a_thread_of_its_own

MAX_NEW = 12


def random_prompts(lengths, vocab=512, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def greedy(max_tokens=MAX_NEW, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def assert_diverse(expected):
    """Random weights can collapse onto one repeated token, which would hide most bugs."""
    for tokens in expected:
        assert len(set(tokens)) >= 3, f"oracle output is degenerate: {tokens}"
    everything = [t for tokens in expected for t in tokens]
    assert len(set(everything)) >= len(everything) // 3, "oracle outputs share too few tokens"


def run_llm(model_dir, prompts, **engine_args):
    llm = LLM(model=str(model_dir), dtype="float32", **engine_args)
    outputs = llm.generate(prompts, greedy())
    return llm, [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def prompts16():
    lengths = [1, 2, 3, 5, 8, 13, 17, 31, 32, 33, 64, 100, 127, 200, 257, 300]
    return random_prompts(lengths, seed=16)


def test_one_prompt(tiny_llama_dir, hf_greedy):
    [prompt] = random_prompts([23])
    expected = hf_greedy(tiny_llama_dir, [prompt], MAX_NEW, ignore_eos=True)
    assert_diverse(expected)
    _, got = run_llm(tiny_llama_dir, [prompt])
    assert got == expected


# the native C++ kernels (each build this CPU runs: kernels/cpu_native.py, "cpu-avx2" its AVX2 build), the references
NATIVE_BUILDS = {("cpu" if target == "native" else f"cpu-{target}"): target for target in cpu_native.runnable_isas()}


@pytest.mark.parametrize("kernel_backend", [*NATIVE_BUILDS, "torch"])
def test_sixteen_prompts_of_lengths_1_to_300_submitted_together(
    tiny_llama_dir, hf_greedy, prompts16, kernel_backend, monkeypatch
):
    expected = hf_greedy(tiny_llama_dir, prompts16, MAX_NEW, ignore_eos=True)
    assert_diverse(expected)
    if kernel_backend in NATIVE_BUILDS:
        monkeypatch.setenv("SHARDSERVE_CPU_ISA", NATIVE_BUILDS[kernel_backend])
    llm, got = run_llm(tiny_llama_dir, prompts16, kernel_backend=kernel_backend.split("-")[0])
    backend = llm.engine.executor.runner.backend
    if kernel_backend in NATIVE_BUILDS:
        assert backend is engine_cpu_backend(NATIVE_BUILDS[kernel_backend])
    else:
        assert backend.name == kernel_backend
    assert got == expected


def test_products_on_padded_row_counts_equal_transformers(tiny_llama_dir, hf_greedy, prompts16, monkeypatch):
    """The packed products of a step of more than EXACT_ROWS_MAX rows run on a row-count bucket (kernels/linear.py
    padded_rows): the first step here has 1,193 prompt tokens, run as 1,216 rows."""
    from kernels import linear as linear_module
    from tests.kernels.test_linear_row_buckets import record_row_counts

    expected = hf_greedy(tiny_llama_dir, prompts16, MAX_NEW, ignore_eos=True)
    row_counts = record_row_counts(monkeypatch)
    _, got = run_llm(tiny_llama_dir, prompts16, kernel_backend="cpu")
    tokens = sum(map(len, prompts16))
    assert tokens > linear_module.EXACT_ROWS_MAX and tokens not in row_counts
    assert linear_module.padded_rows(tokens) in row_counts  # the projections and MLP of the first step
    assert got == expected


def test_threads_bound_to_cores_equal_transformers(tiny_llama_dir, hf_greedy, prompts16):
    """cpu_threads_bind: one torch thread on each core, in the list's order (engine/cpu_binding.py)."""
    expected = hf_greedy(tiny_llama_dir, prompts16, MAX_NEW, ignore_eos=True)
    cores = sorted(allowed_cores(), reverse=True)

    def generate_bound():
        llm, got = run_llm(tiny_llama_dir, prompts16, cpu_threads_bind=",".join(map(str, cores)))
        try:
            return got, os.sched_getaffinity(0), llm.engine.executor.runner.cpu_threads
        finally:
            llm.shutdown()

    got, step_thread_cores, threads = on_a_thread_of_its_own(generate_bound)
    assert (step_thread_cores, threads) == ({cores[0]}, len(cores))
    assert got == expected


def test_staggered_arrival_while_others_decode(tiny_llama_dir, hf_greedy):
    prompts = random_prompts([40, 7, 90, 15, 60], seed=3)
    expected = hf_greedy(tiny_llama_dir, prompts, MAX_NEW, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"))
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    saw_decode_with_newcomer = False
    while pending or engine.has_unfinished_requests():
        if pending and engine.num_steps % 3 == 0:
            index, prompt = pending.pop(0)
            engine.add_request(str(index), prompt, greedy())
        running_before = len(engine.scheduler.running)
        for delta in engine.step():
            got.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
        saw_decode_with_newcomer |= running_before > 0 and engine.num_mixed_steps > 0
    assert saw_decode_with_newcomer
    assert [got[str(i)] for i in range(len(prompts))] == expected


def test_chunked_prefill_shares_steps_with_decodes(tiny_llama_dir, hf_greedy, prompts16):
    expected = hf_greedy(tiny_llama_dir, prompts16, MAX_NEW, ignore_eos=True)
    llm, got = run_llm(tiny_llama_dir, prompts16, max_num_batched_tokens=32)
    assert got == expected
    assert llm.engine.num_mixed_steps > 0, "no step mixed a prefill chunk with decodes"


def test_blocks_of_64_tokens_with_chunks_and_prefix_hits_equal_transformers(tiny_llama_dir, hf_greedy, prompts16):
    """KV blocks of 64 tokens (vLLM's CPU default is 128): the native kernels read them as runs of 16-token
    blocks (kernels/backend.py as_kernel_blocks), through chunked prefill beside decodes and then prefix-cache hits
    of whole blocks."""
    expected = hf_greedy(tiny_llama_dir, prompts16, MAX_NEW, ignore_eos=True)
    llm, got = run_llm(tiny_llama_dir, prompts16, block_size=64, max_num_batched_tokens=48)
    assert llm.engine.executor.runner.backend is engine_cpu_backend(cpu_native.isa())
    assert got == expected
    assert llm.engine.num_mixed_steps > 0
    again = llm.generate(prompts16, greedy())
    assert [o.outputs[0].token_ids for o in again] == expected
    assert max(o.num_cached_tokens for o in again) >= 256  # the 257- and 300-token prompts' first 4 blocks


def test_preemption_under_a_small_kv_pool_keeps_outputs_and_frees_every_block(tiny_llama_dir, hf_greedy):
    prompts = random_prompts([30, 45, 20, 60, 33, 50], seed=5)
    expected = hf_greedy(tiny_llama_dir, prompts, 24, ignore_eos=True)
    # 16 blocks of 16 tokens = 256 slots for ~240 prompt tokens + 6 × 24 outputs
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=16, max_model_len=256)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(max_tokens=24))]
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was large enough: no preemption happened"
    assert got == expected
    manager = llm.engine.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    manager.check_invariants()


@pytest.mark.parametrize("fixture", ["tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_preemption_combined_with_chunked_prefill(fixture, request, hf_greedy):
    model_dir = request.getfixturevalue(fixture)
    prompts = random_prompts([70, 20, 90, 35], seed=7)
    expected = hf_greedy(model_dir, prompts, 16, ignore_eos=True)
    assert_diverse(expected)
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=14, max_model_len=200,
              max_num_batched_tokens=24, block_size=16)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(max_tokens=16))]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.num_mixed_steps > 0
    assert got == expected


@pytest.mark.parametrize(
    "fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_llama3_rope_dir"]
)
def test_architectures_match_transformers(fixture, request, hf_greedy):
    model_dir = request.getfixturevalue(fixture)
    prompts = random_prompts([9, 50, 120], seed=11)
    expected = hf_greedy(model_dir, prompts, MAX_NEW, ignore_eos=True)
    assert_diverse(expected)
    _, got = run_llm(model_dir, prompts, max_num_batched_tokens=64)
    assert got == expected


def test_logprobs_of_chosen_tokens_match_transformers(tiny_llama_dir, hf_greedy):
    prompts = random_prompts([12, 40], seed=21)
    hf_model = hf_greedy.model(tiny_llama_dir)
    llm = LLM(model=str(tiny_llama_dir), dtype="float32")
    outputs = llm.generate(prompts, greedy(max_tokens=8, logprobs=3))
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        full = torch.tensor([prompt + completion.token_ids])
        with torch.inference_mode():
            hf_logprobs = torch.log_softmax(hf_model(full).logits[0].float(), dim=-1)
        for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = hf_logprobs[len(prompt) - 1 + step]
            assert abs(entry[token] - row[token].item()) < 1e-4
            assert len(entry) in (3, 4)  # top-3 plus the chosen token when it is not among them
            top3 = row.topk(3).indices.tolist()
            assert set(top3) <= set(entry)
        assert completion.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(completion.token_ids, completion.logprobs)))


def test_greedy_requests_among_sampled_ones_still_match_transformers(tiny_llama_dir, hf_greedy):
    """Mixed batches send greedy rows through the fused sampler (temperature 0: its argmax), not torch's."""
    prompts = random_prompts([15, 40, 70], seed=31)
    expected = hf_greedy(tiny_llama_dir, prompts, MAX_NEW, ignore_eos=True)
    assert_diverse(expected)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=MAX_NEW, ignore_eos=True, seed=5)
    llm = LLM(model=str(tiny_llama_dir), dtype="float32")
    outputs = llm.generate(prompts + random_prompts([20, 33], seed=32), [greedy()] * 3 + [sampled] * 2)
    assert [o.outputs[0].token_ids for o in outputs[:3]] == expected


# ---- speculative decoding (engine/spec_decode/): n-gram proposals verified in one forward pass ----------------

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SPEC_NEW = 40


@pytest.fixture(scope="module")
def looping_prompts():
    """Prompts for the looping model, one of which repeats itself (its continuation may be found in it)."""
    prompts = random_prompts([10, 40, 25, 7, 60], seed=59)
    return prompts + [prompts[0] * 3]


def looping_oracle(hf_greedy, model_dir, prompts, max_new=SPEC_NEW):
    expected = hf_greedy(model_dir, prompts, max_new, ignore_eos=True)
    for tokens in expected:
        assert len(set(tokens)) >= 6, f"oracle output is degenerate: {tokens}"
    return expected


def speculative_llm(model_dir, **engine_args) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", speculative_config=SPECULATIVE, **engine_args)


def assert_proposals_accepted_and_rejected(llm):
    """Both paths ran (some proposals kept, some rolled back), and every block came back."""
    spec = llm.engine.stats().speculation
    assert 0 < spec.num_accepted_tokens < spec.num_proposed_tokens, spec
    llm.engine.scheduler.block_manager.check_all_free()


def test_speculative_greedy_alone_equals_transformers(tiny_llama_looping_dir, hf_greedy, looping_prompts):
    expected = looping_oracle(hf_greedy, tiny_llama_looping_dir, looping_prompts)
    llm = speculative_llm(tiny_llama_looping_dir)
    for prompt, tokens in zip(looping_prompts, expected):
        assert llm.generate([prompt], greedy(SPEC_NEW))[0].outputs[0].token_ids == tokens
    assert_proposals_accepted_and_rejected(llm)


def test_speculative_greedy_batched_equals_transformers(tiny_llama_looping_dir, hf_greedy, looping_prompts):
    expected = looping_oracle(hf_greedy, tiny_llama_looping_dir, looping_prompts)
    llm = speculative_llm(tiny_llama_looping_dir)
    got = [o.outputs[0].token_ids for o in llm.generate(looping_prompts, greedy(SPEC_NEW))]
    assert got == expected
    assert_proposals_accepted_and_rejected(llm)


def test_speculative_chunks_share_the_token_budget_with_prefill_chunks(tiny_llama_looping_dir, hf_greedy,
                                                                       looping_prompts):
    expected = looping_oracle(hf_greedy, tiny_llama_looping_dir, looping_prompts)
    llm = speculative_llm(tiny_llama_looping_dir, max_num_batched_tokens=16)
    got = [o.outputs[0].token_ids for o in llm.generate(looping_prompts, greedy(SPEC_NEW))]
    assert got == expected
    assert llm.engine.num_mixed_steps > 0, "no step mixed a prefill chunk with decodes"
    assert_proposals_accepted_and_rejected(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_speculative_greedy_under_preemption_equals_transformers(tiny_llama_looping_dir, hf_greedy,
                                                                 looping_prompts, mode):
    expected = looping_oracle(hf_greedy, tiny_llama_looping_dir, looping_prompts)
    # 16 blocks of 16 tokens = 256 slots for ~200 prompt tokens + 6 × 40 outputs
    llm = speculative_llm(tiny_llama_looping_dir, num_kv_blocks=16, max_model_len=256, preemption_mode=mode,
                          swap_space=64 * 32768 / 2**30)
    got = [o.outputs[0].token_ids for o in llm.generate(looping_prompts, greedy(SPEC_NEW))]
    assert llm.engine.scheduler.num_preemptions_by_mode[mode] > 0, f"nothing was preempted by {mode}"
    assert got == expected
    assert_proposals_accepted_and_rejected(llm)


def test_speculative_greedy_over_prefix_cache_hits_equals_transformers(tiny_llama_looping_dir, hf_greedy,
                                                                        looping_prompts):
    """A second round of the same prompts starts from the blocks the first cached (with their outputs')."""
    expected = looping_oracle(hf_greedy, tiny_llama_looping_dir, looping_prompts)
    llm = speculative_llm(tiny_llama_looping_dir, block_size=8)
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in llm.generate(looping_prompts, greedy(SPEC_NEW))]
        assert got == expected
    assert llm.engine.scheduler.prefix_cache_hits > 0
    assert_proposals_accepted_and_rejected(llm)
    llm.engine.scheduler.block_manager.check_invariants()


def test_speculative_max_tokens_landing_inside_an_accepted_run_cuts_there(tiny_llama_looping_dir, hf_greedy,
                                                                          looping_prompts):
    prompt = looping_prompts[1]
    [expected] = looping_oracle(hf_greedy, tiny_llama_looping_dir, [prompt])
    llm = speculative_llm(tiny_llama_looping_dir)
    limits = list(range(1, SPEC_NEW + 1))
    outputs = llm.generate([prompt] * len(limits), [greedy(max_tokens=m) for m in limits])
    for limit, output in zip(limits, outputs):
        assert output.outputs[0].token_ids == expected[:limit]
        assert output.outputs[0].finish_reason == "length"
    assert_proposals_accepted_and_rejected(llm)


def test_speculative_stop_strings_end_where_they_do_without_speculation(tiny_llama_looping_dir, looping_prompts):
    """The stop string is text from the looping part of the output, so it lands inside accepted runs."""
    plain = LLM(model=str(tiny_llama_looping_dir), dtype="float32")
    tokenizer = plain.get_tokenizer()
    stops = []
    for output in plain.generate(looping_prompts, greedy(SPEC_NEW)):
        tokens = output.outputs[0].token_ids
        stops.append(tokenizer.decode(tokens[24:26]).strip() or tokenizer.decode(tokens[24:28]))
    params = [greedy(SPEC_NEW, stop=[stop]) for stop in stops]
    expected = plain.generate(looping_prompts, params)
    llm = speculative_llm(tiny_llama_looping_dir)
    got = llm.generate(looping_prompts, params)
    assert [o.outputs[0].finish_reason for o in expected].count("stop") >= len(stops) // 2
    for want, have in zip(expected, got):
        assert have.outputs[0].text == want.outputs[0].text
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert (have.outputs[0].finish_reason, have.outputs[0].stop_reason) == (
            want.outputs[0].finish_reason, want.outputs[0].stop_reason)
    assert_proposals_accepted_and_rejected(llm)


@pytest.mark.parametrize("draft", ["tiny_llama_looping_dir", "tiny_llama_looping_draft_dir"],
                         ids=["the-target-as-its-own-draft", "another-model"])
def test_draft_model_speculation_equals_transformers_under_chunks_and_preemption(tiny_llama_looping_dir, hf_greedy,
                                                                                 looping_prompts, draft, request):
    """The draft's own KV cache follows the target's accepted tokens: all of them (the target as its own draft
    accepts every proposal) or none (another random model's are rejected)."""
    expected = looping_oracle(hf_greedy, tiny_llama_looping_dir, looping_prompts)
    speculative = {"method": "draft_model", "model": str(request.getfixturevalue(draft)), "num_speculative_tokens": 3}
    llm = LLM(model=str(tiny_llama_looping_dir), dtype="float32", speculative_config=speculative, num_kv_blocks=16,
              max_model_len=256, max_num_batched_tokens=32)
    got = [o.outputs[0].token_ids for o in llm.generate(looping_prompts, greedy(SPEC_NEW))]
    assert got == expected
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.num_mixed_steps > 0
    spec = llm.engine.stats().speculation
    if draft == "tiny_llama_looping_dir":
        assert spec.num_accepted_tokens == spec.num_proposed_tokens > 0
    else:
        assert spec.num_accepted_tokens < spec.num_proposed_tokens
    llm.engine.scheduler.block_manager.check_all_free()
    llm.engine.draft_proposer.block_manager.check_all_free()
