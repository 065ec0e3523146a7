"""Our Llama / Qwen2 / Qwen3 against transformers on the same weights, and the tensor-parallel shards."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engine.attention import AttentionMetadata
from engine.checkpoint.loader import load_model
from engine.checkpoint.model_config import load_model_config
from kernels.backend import get_backend
from parallel.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from parallel.state import ParallelContext

BLOCK_SIZE = 4
PROMPTS = [
    [1, 17, 300, 42, 99, 5, 511, 64, 7, 250, 3],  # 11 tokens: spans 3 blocks
    [1, 200],
    [1, 9, 8, 7, 6, 5, 4, 3, 100, 101, 102, 103, 104, 105, 106, 107, 108],  # 17: a fifth block
]


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _block_tables(prompt_lens: list[int], extra_tokens: int) -> torch.Tensor:
    """Consecutive fresh blocks per sequence, with room for `extra_tokens` more: [num_seqs, max_blocks]."""
    blocks_per_seq = max(-(-(n + extra_tokens) // BLOCK_SIZE) for n in prompt_lens)
    return torch.arange(len(prompt_lens) * blocks_per_seq, dtype=torch.int32).view(
        len(prompt_lens), blocks_per_seq
    )


def _slots(block_table: torch.Tensor, positions: range) -> list[int]:
    return [int(block_table[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def prefill_metadata(prompt_lens: list[int], block_tables: torch.Tensor) -> AttentionMetadata:
    """Whole prompts prefilled in one step into fresh blocks; no decodes."""
    slots = [s for n, table in zip(prompt_lens, block_tables) for s in _slots(table, range(n))]
    starts = [0]
    for n in prompt_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decode_tokens=0,
        decode_block_tables=torch.zeros((0, block_tables.shape[1]), dtype=torch.int32),
        decode_context_lens=_i32([]),
        num_prefill_tokens=sum(prompt_lens),
        prefill_block_tables=block_tables,
        prefill_query_start_loc=_i32(starts),
        prefill_context_lens=_i32(prompt_lens),
    )


def decode_metadata(context_lens: list[int], block_tables: torch.Tensor) -> AttentionMetadata:
    """One new token per sequence at position context_len - 1; no prefills."""
    slots = [s for n, table in zip(context_lens, block_tables) for s in _slots(table, range(n - 1, n))]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decode_tokens=len(context_lens),
        decode_block_tables=block_tables,
        decode_context_lens=_i32(context_lens),
        num_prefill_tokens=0,
        prefill_block_tables=torch.zeros((0, block_tables.shape[1]), dtype=torch.int32),
        prefill_query_start_loc=_i32([0]),
        prefill_context_lens=_i32([]),
    )


def load_ours(model_dir, parallel: ParallelContext | None = None):
    config = load_model_config(model_dir)
    model = load_model(
        model_dir, config, torch.float32, "cpu", parallel or ParallelContext(), get_backend("torch")
    )
    return model, config


def empty_kv_caches(model, num_blocks: int) -> list[torch.Tensor]:
    shape = (2, model.kv_heads_per_rank, num_blocks, BLOCK_SIZE, model.head_dim)
    return [torch.zeros(shape) for _ in range(model.num_layers)]


@torch.inference_mode()
def transformers_reference(model_dir, hf_greedy) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """HF's logits at every prompt position, its greedy next token per prompt, and the logits
    after that token: ([sum(lens), vocab], [num_prompts], [num_prompts, vocab])."""
    hf = hf_greedy.model(model_dir)
    prefill_logits = torch.cat([hf(torch.tensor([p])).logits[0] for p in PROMPTS])
    ends = torch.tensor([len(p) for p in PROMPTS]).cumsum(0).tolist()
    next_tokens = [int(prefill_logits[end - 1].argmax()) for end in ends]
    decode_logits = torch.stack(
        [hf(torch.tensor([p + [t]])).logits[0, -1] for p, t in zip(PROMPTS, next_tokens)]
    )
    # The oracle's choices differ across prompts: the comparison is not between constant outputs.
    assert len(set(next_tokens)) > 1
    return prefill_logits, next_tokens, decode_logits


@torch.inference_mode()
def prefill_then_decode(model, next_tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Our logits: PROMPTS prefilled in one batch, then one decode step of `next_tokens` through
    the paged cache the prefill wrote."""
    lens = [len(p) for p in PROMPTS]
    block_tables = _block_tables(lens, extra_tokens=1)
    kv_caches = empty_kv_caches(model, block_tables.numel())
    input_ids = torch.tensor([t for p in PROMPTS for t in p])
    positions = torch.tensor([i for n in lens for i in range(n)])
    hidden = model(input_ids, positions, kv_caches, prefill_metadata(lens, block_tables))
    prefill_logits = model.compute_logits(hidden)
    decode_meta = decode_metadata([n + 1 for n in lens], block_tables)
    hidden = model(torch.tensor(next_tokens), torch.tensor(lens), kv_caches, decode_meta)
    return prefill_logits, model.compute_logits(hidden)


def assert_prefill_then_decode_match_transformers(model_dir, hf_greedy) -> None:
    expected_prefill, next_tokens, expected_decode = transformers_reference(model_dir, hf_greedy)
    ours, config = load_ours(model_dir)
    prefill_logits, decode_logits = prefill_then_decode(ours, next_tokens)
    assert prefill_logits.dtype == torch.float32 and prefill_logits.shape == expected_prefill.shape
    assert prefill_logits.shape[1] == config.vocab_size
    torch.testing.assert_close(prefill_logits, expected_prefill, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode_logits, expected_decode, atol=1e-5, rtol=1e-5)


def test_llama_gqa_prefill_and_decode_logits_match_transformers(tiny_llama_gqa_dir, hf_greedy):
    config = load_model_config(tiny_llama_gqa_dir)
    assert config.num_key_value_heads < config.num_attention_heads and not config.tie_word_embeddings
    assert_prefill_then_decode_match_transformers(tiny_llama_gqa_dir, hf_greedy)


def test_llama3_rope_scaling_logits_match_transformers(tiny_llama3_rope_dir, hf_greedy):
    assert load_model_config(tiny_llama3_rope_dir).rope_scaling["rope_type"] == "llama3"
    assert_prefill_then_decode_match_transformers(tiny_llama3_rope_dir, hf_greedy)


def test_qwen2_with_qkv_bias_and_tied_embeddings_matches_transformers(tiny_qwen2_dir, hf_greedy):
    config = load_model_config(tiny_qwen2_dir)
    assert config.attention_bias and config.tie_word_embeddings
    assert_prefill_then_decode_match_transformers(tiny_qwen2_dir, hf_greedy)


def test_qwen3_with_qk_norm_and_explicit_head_dim_matches_transformers(tiny_qwen3_dir, hf_greedy):
    config = load_model_config(tiny_qwen3_dir)
    assert config.architecture == "qwen3" and not config.attention_bias and config.tie_word_embeddings
    assert config.head_dim != config.hidden_size // config.num_attention_heads
    assert_prefill_then_decode_match_transformers(tiny_qwen3_dir, hf_greedy)


@pytest.mark.parametrize(("model_type", "bias"), [("qwen2", True), ("qwen3", False)])
def test_attention_bias_defaults_follow_transformers(model_type, bias, tmp_path):
    """A config.json without `attention_bias`: Qwen2 always has q/k/v bias, Qwen3 has none."""
    raw = dict(
        model_type=model_type,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = load_model_config(tmp_path)
    assert (config.architecture, config.attention_bias, config.head_dim) == (model_type, bias, 16)


def test_qwen3_qk_norm_weights_are_whole_on_every_tensor_parallel_rank(tiny_qwen3_dir):
    """The norms act per head with one [head_dim] weight: each rank needs all of it, not a shard."""
    checkpoint = load_file(tiny_qwen3_dir / "model.safetensors")
    for rank in range(2):
        model, config = load_ours(tiny_qwen3_dir, ParallelContext(rank=rank, world_size=2))
        attention = model.model.layers[1].self_attn
        assert attention.num_heads == config.num_attention_heads // 2
        for name in ("q_norm", "k_norm"):
            expected = checkpoint[f"model.layers.1.self_attn.{name}.weight"]
            assert torch.equal(getattr(attention, name).weight, expected)
    assert not torch.equal(attention.q_norm.weight, attention.k_norm.weight)  # each loaded from its own tensor


def test_rotary_cache_is_a_float32_buffer_on_the_model_device(tiny_llama_dir):
    model, config = load_ours(tiny_llama_dir)
    assert "cos_sin_cache" in dict(model.named_buffers())
    assert "cos_sin_cache" not in dict(model.named_parameters())
    assert model.cos_sin_cache.dtype == torch.float32
    assert model.cos_sin_cache.shape == (config.max_position_embeddings, config.head_dim)


def test_a_rope_scaled_context_past_max_position_embeddings_has_rotary_rows_for_every_position(
    tiny_llama3_rope_dir,
):
    """max_model_len may pass max_position_embeddings under rope_scaling: the engine's rotary table covers it,
    so a token at position 1100 of a model with 1024 positions rotates by its own angle."""
    from engine import LLM, SamplingParams
    from kernels.rotary import rope_cos_sin_cache

    config = load_model_config(tiny_llama3_rope_dir)
    llm = LLM(str(tiny_llama3_rope_dir), max_model_len=1536, num_kv_blocks=100, kernel_backend="torch")
    try:
        table = llm.engine.executor.runner.model.cos_sin_cache
        assert config.max_position_embeddings == 1024 and table.shape[0] == 1536
        want = rope_cos_sin_cache(config.head_dim, 1536, config.rope_theta, config.rope_scaling)
        torch.testing.assert_close(table, want)
        prompt = [(7 * i) % 1000 + 3 for i in range(1100)]
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()


# ---------------------------------------------------------------- tensor-parallel weight shards
# Each rank's layer is built alone with ParallelContext(rank, tp): no process group is needed to
# check that its weight_loader cuts the right shard of the full checkpoint tensor.

HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS = 8, 2, 4, 2


def _ranks(tp: int) -> list[ParallelContext]:
    return [ParallelContext(rank=r, world_size=tp) for r in range(tp)]


@pytest.mark.parametrize("tp", [2, 4])
def test_qkv_shards_split_query_heads_and_split_or_replicate_kv_heads(tp):
    q = torch.randn(NUM_HEADS * HEAD_DIM, HIDDEN)
    k = torch.randn(NUM_KV_HEADS * HEAD_DIM, HIDDEN)
    v = torch.randn(NUM_KV_HEADS * HEAD_DIM, HIDDEN)
    q_bias, k_bias, v_bias = torch.randn(len(q)), torch.randn(len(k)), torch.randn(len(v))
    shards = []
    for parallel in _ranks(tp):
        layer = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, parallel, bias=True)
        for full, full_bias, shard_id in ((q, q_bias, "q"), (k, k_bias, "k"), (v, v_bias, "v")):
            layer.weight.weight_loader(layer.weight, full, shard_id)
            layer.bias.weight_loader(layer.bias, full_bias, shard_id)
        shards.append((layer, *layer.weight.split([layer.q_size, layer.kv_size, layer.kv_size])))

    assert torch.equal(torch.cat([s[1] for s in shards]), q)
    assert torch.equal(torch.cat([s[0].split(s[0].bias)[0] for s in shards]), q_bias)
    kv_per_rank = max(NUM_KV_HEADS // tp, 1)
    for rank, (layer, _, k_shard, v_shard) in enumerate(shards):
        assert layer.kv_heads_per_rank == kv_per_rank
        # tp=4 > 2 KV heads: ranks 0,1 hold KV head 0 and ranks 2,3 hold KV head 1.
        first = rank * NUM_KV_HEADS // tp
        rows = slice(first * HEAD_DIM, (first + kv_per_rank) * HEAD_DIM)
        assert torch.equal(k_shard, k[rows]) and torch.equal(v_shard, v[rows])
        assert torch.equal(layer.split(layer.bias)[1], k_bias[rows])
    if tp == 4:
        assert torch.equal(shards[0][2], shards[1][2]) and not torch.equal(shards[1][2], shards[2][2])
    else:
        assert torch.equal(torch.cat([s[2] for s in shards]), k)


@pytest.mark.parametrize("tp", [2, 4])
def test_merged_gate_up_shard_is_gate_shard_then_up_shard(tp):
    inter = 8
    gate, up = torch.randn(inter, HIDDEN), torch.randn(inter, HIDDEN)
    gates, ups = [], []
    for parallel in _ranks(tp):
        layer = MergedColumnParallelLinear(HIDDEN, [inter, inter], parallel)
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        gate_shard, up_shard = layer.weight.chunk(2)
        gates.append(gate_shard)
        ups.append(up_shard)
    assert torch.equal(torch.cat(gates), gate) and torch.equal(torch.cat(ups), up)


@pytest.mark.parametrize("tp", [2, 4])
def test_column_then_row_parallel_sum_to_the_full_product(tp):
    x = torch.randn(3, HIDDEN)
    w_col, w_row, b_row = torch.randn(16, HIDDEN), torch.randn(HIDDEN, 16), torch.randn(HIDDEN)
    partial_sums = []
    for parallel in _ranks(tp):
        col = ColumnParallelLinear(HIDDEN, 16, parallel)
        col.weight.weight_loader(col.weight, w_col)
        row = RowParallelLinear(16, HIDDEN, parallel, bias=True)
        row.weight.weight_loader(row.weight, w_row)
        row.bias.weight_loader(row.bias, b_row)
        assert torch.equal(row.bias, b_row)  # every rank holds the whole bias, added once after the reduce
        partial_sums.append(F.linear(col(x), row.weight))  # what each rank contributes to the all-reduce
    expected = F.linear(F.linear(x, w_col), w_row, b_row)
    torch.testing.assert_close(torch.stack(partial_sums).sum(0) + b_row, expected)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_is_padded_to_a_multiple_of_tp_and_logits_trimmed(tp):
    vocab = 10  # tp=4 pads to 12: ranks own 3 ids each, rank 3 owns id 9 and two zero rows
    embedding = torch.randn(vocab, HIDDEN)
    hidden = torch.randn(2, HIDDEN)
    real_rows, local_logits = [], []
    for parallel in _ranks(tp):
        head = ParallelLMHead(vocab, HIDDEN, parallel)
        head.weight.weight_loader(head.weight, embedding)
        assert head.padded_vocab_size % tp == 0 and head.padded_vocab_size >= vocab
        owned = head.vocab_end - head.vocab_start
        assert not head.weight[owned:].any()  # padding rows are zero
        real_rows.append(head.weight[:owned])
        local_logits.append(F.linear(hidden, head.weight))
    assert torch.equal(torch.cat(real_rows), embedding)
    gathered = torch.cat(local_logits, dim=-1)[:, :vocab]  # what all_gather + trim produce
    torch.testing.assert_close(gathered, hidden @ embedding.T)


def test_vocab_parallel_embedding_at_tp1_is_a_plain_lookup():
    embedding = torch.randn(10, HIDDEN)
    layer = VocabParallelEmbedding(10, HIDDEN, ParallelContext())
    layer.weight.weight_loader(layer.weight, embedding)
    ids = torch.tensor([0, 9, 3])
    assert torch.equal(layer(ids), embedding[ids])


# ---------------------------------------------------------------- tensor parallelism over gloo


def _tp_rank(rank: int, tp: int, model_dir: str, next_tokens: list[int], store: str, out: str) -> None:
    """One rank of a tensor-parallel group (a spawned process): rank 0 saves the logits."""
    import os
    import sys
    import time

    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo otherwise connects over the host's interface address
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp)
    try:
        model, _ = load_ours(model_dir, ParallelContext(rank=rank, world_size=tp, group=dist.group.WORLD))
        logits = prefill_then_decode(model, next_tokens)
        if rank == 0:
            torch.save(logits, out)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leave without tearing gloo down: a rank destroying its gloo context while a peer's gloo thread
    # still touches the connection aborts that peer ("terminate called without an active exception"),
    # even after a barrier. So every rank first waits, through the file store rather than gloo, until
    # all are past the barrier, then exits at once, skipping the destructors.
    store = dist.distributed_c10d._get_default_store()
    store.add("past_barrier", 1)
    while store.add("past_barrier", 0) < tp:
        time.sleep(0.01)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Each rank is a spawned process (a few seconds to import torch): the cases cover KV-head
# replication (tp 4 > 2 KV heads), sharded qkv bias plus a tied, vocab-parallel head, and
# replicated per-head q/k norms.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "tp"),
    [("llama", 4), ("qwen2", 2), ("qwen3", 2)],
    ids=["llama-tp4-replicated-kv", "qwen2-tp2-tied", "qwen3-tp2-qk-norm"],
)
def test_tensor_parallel_logits_match_transformers(arch, tp, request, hf_greedy, tmp_path):
    import torch.multiprocessing as mp

    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    expected_prefill, next_tokens, expected_decode = transformers_reference(model_dir, hf_greedy)
    out = tmp_path / "logits.pt"
    mp.spawn(_tp_rank, args=(tp, str(model_dir), next_tokens, str(tmp_path / "store"), str(out)), nprocs=tp)
    prefill_logits, decode_logits = torch.load(out)
    # Partial sums are reduced in another order than one matmul adds them: float32 rounding.
    torch.testing.assert_close(prefill_logits, expected_prefill, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decode_logits, expected_decode, atol=1e-4, rtol=1e-4)
