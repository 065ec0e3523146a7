"""Tensor parallelism on CPU (gloo, local Ray): greedy tokens equal TP=1's and Hugging Face's, and
each rank holds 1/tp of the weights and KV cache plus what must be replicated."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import ray

from engine.config import SamplingParams
from engine.cpu_binding import allowed_cores
from engine.llm_engine import LLM
from engine.models import model_class_for
from tests.engine.test_cpu_binding import on_a_thread_of_its_own

pytestmark = pytest.mark.usefixtures("ray_session")

MAX_TOKENS = 20
# Small budget and cache: prompts are prefilled in chunks of 16 tokens beside running decodes, and
# 4 sequences of up to 70 tokens (9 blocks of 8 each) cannot all fit in 16 blocks, so the
# scheduler preempts and recomputes.
CHUNKED_AND_PREEMPTING = dict(block_size=8, num_kv_blocks=16, max_model_len=128, max_num_batched_tokens=16)
ROOMY = dict(block_size=8, num_kv_blocks=64, max_model_len=128)
# The same squeeze, preempting by swapping KV blocks to each rank's host pool and back.
SWAPPING = dict(CHUNKED_AND_PREEMPTING, preemption_mode="swap", swap_space=64 * 16384 / 2**30)

# (model fixture, tp, engine settings, what the case is about)
CASES = [
    ("tiny_llama_dir", 2, CHUNKED_AND_PREEMPTING, "llama-gqa-tp-equals-kv-heads"),
    ("tiny_llama_dir", 4, CHUNKED_AND_PREEMPTING, "llama-kv-heads-replicated"),
    ("tiny_llama_dir", 2, SWAPPING, "llama-swap-preemption"),
    ("tiny_qwen2_dir", 2, CHUNKED_AND_PREEMPTING, "qwen2-bias-tied"),
    ("tiny_qwen2_dir", 4, ROOMY, "qwen2-bias-tied-kv-replicated"),
    ("tiny_qwen3_dir", 2, CHUNKED_AND_PREEMPTING, "qwen3-qk-norm-head-dim-128-tied"),
    ("tiny_llama_odd_vocab_dir", 2, ROOMY, "vocab-1021-padded-to-1022"),
    ("tiny_llama_odd_vocab_dir", 4, CHUNKED_AND_PREEMPTING, "vocab-1021-padded-to-1024"),
]


def prompts_for(vocab_size: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (6, 37, 21, 50)]


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def tp1_engines():
    """TP=1 engines by (model dir, settings), made on first use."""
    engines: dict[tuple, LLM] = {}

    def get(model_dir, settings: dict) -> LLM:
        key = (str(model_dir), tuple(sorted(settings.items())))
        if key not in engines:
            engines[key] = LLM(str(model_dir), **settings)
        return engines[key]

    yield get
    for llm in engines.values():
        llm.shutdown()


@pytest.fixture(scope="module", params=CASES, ids=[case[3] for case in CASES])
def tp_case(request):
    """One TP engine at a time (pytest groups the tests by case), shut down after its tests."""
    fixture, tp, settings, _ = request.param
    model_dir = request.getfixturevalue(fixture)
    llm = LLM(str(model_dir), tensor_parallel_size=tp, **settings)
    yield model_dir, tp, settings, llm
    llm.shutdown()


def test_greedy_tokens_equal_tp1_and_hugging_face(tp_case, tp1_engines, hf_greedy):
    model_dir, tp, settings, llm = tp_case
    prompts = prompts_for(llm.engine.model_config.vocab_size)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS, ignore_eos=True)
    assert all(len(set(tokens)) >= MAX_TOKENS // 2 for tokens in expected), "oracle outputs are degenerate"

    assert greedy(tp1_engines(model_dir, settings), prompts) == expected
    assert greedy(llm, prompts) == expected
    if settings in (CHUNKED_AND_PREEMPTING, SWAPPING):
        assert llm.engine.num_mixed_steps > 0, "no prefill chunk ran beside decodes"
        mode = settings.get("preemption_mode", "recompute")
        assert llm.engine.scheduler.num_preemptions_by_mode[mode] > 0, f"nothing was preempted by {mode}"


def test_each_rank_holds_a_tp_share_of_weights_and_kv_cache(tp_case, tp1_engines):
    model_dir, tp, settings, llm = tp_case
    config = llm.engine.model_config
    (single,) = tp1_engines(model_dir, settings).engine.executor.memory()
    ranks = llm.engine.executor.memory()
    assert [r.rank for r in ranks] == list(range(tp))

    element = 4  # float32
    hidden, layers, head_dim = config.hidden_size, config.num_hidden_layers, config.head_dim
    kv_heads = config.num_key_value_heads
    kv_heads_per_rank = max(1, kv_heads // tp)  # a KV head is replicated when tp > kv_heads
    kv_row = hidden + (1 if config.attention_bias else 0)  # k/v weight row plus its bias
    # replicated: every norm; per-rank KV projections and the padded vocabulary are counted apart
    replicated = (2 * layers + 1) * hidden * element
    if model_class_for(config).qk_norm:
        replicated += layers * 2 * head_dim * element  # Qwen3's q_norm and k_norm
    kv_proj = layers * 2 * kv_heads * head_dim * kv_row * element
    kv_proj_per_rank = layers * 2 * kv_heads_per_rank * head_dim * kv_row * element
    vocab_tables = 1 if config.tie_word_embeddings else 2
    vocab = vocab_tables * config.vocab_size * hidden * element
    vocab_per_rank = vocab_tables * -(-config.vocab_size // tp) * hidden * element
    evenly_split = single.weight_bytes - replicated - kv_proj - vocab
    expected_weights = evenly_split // tp + replicated + kv_proj_per_rank + vocab_per_rank
    assert [r.weight_bytes for r in ranks] == [expected_weights] * tp
    assert single.weight_bytes / tp < expected_weights < single.weight_bytes / tp * 1.15

    # same block count on every rank, each holding its own KV heads of every block
    assert [r.kv_cache_bytes for r in ranks] == [single.kv_cache_bytes * kv_heads_per_rank // kv_heads] * tp


def test_a_gguf_checkpoint_is_sharded_as_its_safetensors_original(tiny_llama_dir, hf_greedy, tmp_path):
    """Dequantized GGUF weights (llama.cpp's q/k row order undone first) cut into the same TP shards."""
    from tests.engine.gguf_files import write_gguf

    file = write_gguf(tiny_llama_dir, tmp_path / "tiny.gguf")
    prompts = prompts_for(1024)
    expected = hf_greedy(tiny_llama_dir, prompts, MAX_TOKENS, ignore_eos=True)
    llm = LLM(str(file), tensor_parallel_size=2, dtype="float32", **CHUNKED_AND_PREEMPTING)
    try:
        assert greedy(llm, prompts) == expected
    finally:
        llm.shutdown()


def test_constrained_greedy_at_tp2_equals_transformers_under_the_grammar(tiny_llama_dir, hf_greedy):
    """Rank 0 samples through the grammar mask; chunked prefill and preemption run beside it."""
    from engine.config import StructuredOutputsParams
    from tests.engine.grammar_oracle import hf_constrained_greedy

    schema = {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"},
                                               "note": {"type": "string", "maxLength": 10}},
              "required": ["id", "ok", "note"], "additionalProperties": False}
    prompts = prompts_for(1024)
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, dtype="float32", **CHUNKED_AND_PREEMPTING)
    try:
        expected = hf_constrained_greedy(hf_greedy, tiny_llama_dir, llm.get_tokenizer(), prompts, schema, 30)
        params = SamplingParams(temperature=0.0, max_tokens=30,
                                structured_outputs=StructuredOutputsParams(json=schema))
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_greedy_at_tp2_equals_transformers(tiny_llama_looping_dir, hf_greedy, method):
    """Proposals (n-gram, or a draft model on rank 0 only: here the target itself, unsharded) verified by both
    ranks' shards in one pass, rank 0 sampling every position of the chunk; chunked prefill and preemption run
    beside it."""
    rng = random.Random(59)  # prompts whose continuations fall into loops (as test_hf_equivalence's)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (10, 40, 25, 7)]
    expected = hf_greedy(tiny_llama_looping_dir, prompts, MAX_TOKENS, ignore_eos=True)
    speculative = {"method": method, "num_speculative_tokens": 4}
    if method == "draft_model":
        speculative["model"] = str(tiny_llama_looping_dir)
    else:
        speculative.update(prompt_lookup_min=1, prompt_lookup_max=3)
    llm = LLM(str(tiny_llama_looping_dir), tensor_parallel_size=2, dtype="float32",
              speculative_config=speculative, **CHUNKED_AND_PREEMPTING)
    try:
        assert greedy(llm, prompts) == expected
        spec = llm.engine.stats().speculation
        assert 0 < spec.num_accepted_tokens <= spec.num_proposed_tokens, spec
        if method == "ngram":  # (accepting every proposal, the draft case's sequences finish before any preemption)
            assert llm.engine.scheduler.num_preemptions > 0
        llm.engine.scheduler.block_manager.check_all_free()
    finally:
        llm.shutdown()


def thread_affinities(pid: int) -> list[str]:
    """Each thread's Cpus_allowed_list of process pid."""
    lists = []
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        for line in status.read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                lists.append(line.split()[1])
    return lists


def test_tp2_ranks_bound_to_a_core_each_equal_transformers(tiny_llama_dir, hf_greedy):
    """cpu_threads_bind "1|0": rank 0's step thread on core 1, rank 1's (in its Ray worker) on core 0."""
    first, second = sorted(allowed_cores())[:2]
    prompts = prompts_for(512)
    expected = hf_greedy(tiny_llama_dir, prompts, MAX_TOKENS, ignore_eos=True)

    def generate_bound():  # rank 0 steps on this thread, not the test process's main one
        llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, cpu_threads_bind=f"{second}|{first}", **ROOMY)
        try:
            got = greedy(llm, prompts)
            [worker] = llm.engine.executor.workers
            worker_pid = ray.get(worker.__ray_call__.remote(lambda self: os.getpid()))
            return got, os.sched_getaffinity(0), thread_affinities(worker_pid)
        finally:
            llm.shutdown()

    got, rank0_step_thread, rank1_threads = on_a_thread_of_its_own(generate_bound)
    assert rank0_step_thread == {second}
    assert str(first) in rank1_threads, rank1_threads  # its step thread; Ray's own threads keep every core
    assert got == expected
