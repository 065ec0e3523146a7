"""On a GPU the KV cache is sized from a profile (engine/gpu_memory.py): one forward pass at the step's token
budget, its peak and the memory outside torch counted against the engine's share, gpu_memory_utilization x
the card. These run the model runner on CPU with the card's counters stood in for: what torch.cuda's
mem_get_info and allocator counters would read on a card of 256 MiB."""

from __future__ import annotations

import pytest

from engine import model_runner
from engine.checkpoint.model_config import load_model_config
from engine.config import EngineConfig
from engine.gpu_memory import GpuMemoryReading, KVCacheMemoryError, kv_cache_budget
from engine.model_runner import ModelRunner, kv_bytes_per_block

MIB = 2**20
TOKEN_BUDGET = 256


class FakeCard:
    """A GPU's counters as torch.cuda reports them. The weights (`weights`) appear by the time the profile
    step is built, its activations (`activations`) peak during it and stay cached until released; `held`
    is what the process's live tensors hold besides (another engine's weights and KV cache)."""

    def __init__(self, total=256 * MIB, others=0, context=4 * MIB, weights=8 * MIB, activations=6 * MIB, nccl=2 * MIB):
        self.total, self.weights, self.activations, self.nccl = total, weights, activations, nccl
        self.non_torch = others + context  # other processes, and this process's CUDA context
        self.held = 0
        self.cached = 0  # freed blocks torch's allocator keeps
        self.peak = 0
        self.profiled_tokens: list[int] = []

    def profile(self, num_tokens: int) -> None:
        self.held += self.weights
        self.peak = max(self.peak, self.held + self.activations)
        self.cached = self.activations
        self.non_torch += self.nccl  # buffers the first collectives allocate, outside torch
        self.profiled_tokens.append(num_tokens)

    def read(self) -> GpuMemoryReading:
        reserved = self.held + self.cached
        return GpuMemoryReading(self.total - self.non_torch - reserved, self.total, self.held, reserved, self.peak)

    def reset_peak(self) -> None:
        self.peak = self.held

    def release_cached(self) -> None:
        self.cached = 0


@pytest.fixture
def card(monkeypatch) -> FakeCard:
    """The runner sizes its cache on this card (on CPU), and the card sees the profile step being built."""
    card = FakeCard()
    monkeypatch.setattr(model_runner, "gpu_memory_for", lambda device: card)
    real_profile_step = model_runner.profile_step

    def profile_step(num_tokens, *args):
        card.profile(num_tokens)
        return real_profile_step(num_tokens, *args)

    monkeypatch.setattr(model_runner, "profile_step", profile_step)
    return card


def runner(model_dir, utilization: float) -> ModelRunner:
    config = EngineConfig(model=str(model_dir), gpu_memory_utilization=utilization, max_num_batched_tokens=TOKEN_BUDGET,
                          max_num_seqs=8, kernel_backend="torch")
    return ModelRunner(config, load_model_config(model_dir), max_model_len=512)


def per_block(built: ModelRunner) -> int:
    return kv_bytes_per_block(built.model_config, built.config.block_size, built.dtype, built.model.kv_heads_per_rank)


def test_the_cache_gets_the_share_less_the_weights_the_profiled_peak_and_memory_outside_torch(card, tiny_llama_dir):
    built = runner(tiny_llama_dir, 0.9)
    assert card.profiled_tokens == [TOKEN_BUDGET]  # one forward pass, at the step's token budget
    share = int(0.9 * card.total)
    assert built.num_blocks == (share - card.weights - card.activations - card.nccl) // per_block(built)


def test_at_utilization_095_the_engine_leaves_five_percent_of_the_card(card, tiny_llama_dir):
    built = runner(tiny_llama_dir, 0.95)
    kv = built.num_blocks * per_block(built)
    used = card.weights + card.activations + card.nccl + kv  # the CUDA context was there before it
    assert 0.95 * card.total - per_block(built) <= used <= 0.95 * card.total


def test_two_engines_in_one_process_each_take_their_own_share(card, tiny_llama_dir):
    first = runner(tiny_llama_dir, 0.45)
    card.held += first.num_blocks * per_block(first)  # its KV cache, alive while the second one starts
    second = runner(tiny_llama_dir, 0.45)
    expected = (int(0.45 * card.total) - card.weights - card.activations - card.nccl) // per_block(first)
    assert first.num_blocks == second.num_blocks == expected  # the first's memory is not the second's to count
    card.held += second.num_blocks * per_block(second)
    assert card.read().free >= 0.1 * card.total - 2 * per_block(first) - card.non_torch


def test_a_second_engine_asking_for_what_the_first_holds_fails_before_loading_with_what_to_change(
    card, tiny_llama_dir
):
    first = runner(tiny_llama_dir, 0.9)
    card.held += first.num_blocks * per_block(first)
    with pytest.raises(KVCacheMemoryError, match=r"gpu_memory_utilization 0.9 asks for .* lower gpu_memory_utilization"):
        runner(tiny_llama_dir, 0.9)
    assert card.profiled_tokens == [TOKEN_BUDGET]  # the second never got as far as its weights


def test_a_share_too_small_for_any_block_is_an_error_not_a_one_block_cache(card, tiny_llama_dir):
    card.weights = int(0.5 * card.total)
    with pytest.raises(KVCacheMemoryError, match=r"no room for the KV cache .* weights and activation peak"):
        runner(tiny_llama_dir, 0.5)


def test_num_kv_blocks_overrides_the_profile(card, tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=40, kernel_backend="torch")
    assert ModelRunner(config, load_model_config(tiny_llama_dir)).num_blocks == 40
    assert card.profiled_tokens == []


def test_the_budget_counts_only_what_appeared_after_the_engine_started():
    gib = 2**30
    at_start = GpuMemoryReading(free=60 * gib, total=80 * gib, allocated=15 * gib, reserved=16 * gib, peak_allocated=15 * gib)
    after = GpuMemoryReading(free=38 * gib, total=80 * gib, allocated=31 * gib, reserved=36 * gib, peak_allocated=35 * gib)
    budget = kv_cache_budget(at_start, after, 0.5)
    assert (budget.torch_peak, budget.non_torch) == (20 * gib, 2 * gib)  # peak over start; non-torch 4 -> 6 GiB
    assert budget.kv_cache == 40 * gib - 22 * gib
