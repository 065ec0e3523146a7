"""Turns a scheduled step into flat batch tensors and runs one forward pass on this rank's shard.

`prepare_step()` runs on rank 0 only and yields a `StepInput` (the one message broadcast to the
other ranks under tensor parallelism); `execute_model()` runs on every rank, and on rank 0 it also
samples (the runner owns the sampler and the kernel backend both use, chosen once when it is built).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig, ModelConfig, available_memory_bytes
from engine.gpu_memory import GIB, KVCacheMemoryError, check_share_is_free, gpu_memory_for, kv_cache_budget
from engine.sampler import SampledToken, SamplingBatch, sample
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.warmup import LinearWarmUp, warm_up_attention, warm_up_sampling
from kernels.backend import get_backend
from kernels.cpu_threads import bind_threads
from kernels.host_memory import reuse_freed_memory, zeros_on_huge_pages
from parallel.comm import min_over_ranks
from parallel.layers import pack_linear_weights, weight_bytes
from parallel.state import ParallelContext

_CPU_DEFAULT_KV_GB = 2.0


@dataclass
class StepInput:
    """Everything a rank needs for one forward pass (CPU tensors; moved to the device in execute)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [num_sampled] int64: rows of the batch whose logits are needed
    # KV block copies every rank makes before the forward pass (engine/swap.py)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    swap_out_ticket: int | None = None

    def to(self, device: torch.device) -> StepInput:
        """This step's tensors on `device`, copied asynchronously (nothing here waits for the device)."""
        if device.type == "cpu":
            return self
        meta = AttentionMetadata(
            **{
                name: _host_to_device(value, device) if isinstance(value, torch.Tensor) else value
                for name, value in vars(self.meta).items()
            }
        )
        return StepInput(
            _host_to_device(self.input_ids, device),
            _host_to_device(self.positions, device),
            meta,
            _host_to_device(self.sample_indices, device),
            self.swap_out,
            self.swap_in,
            self.swap_out_ticket,
        )


def _host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto a GPU: pinned first (nano-vllm's way), since a non_blocking copy from pageable
    memory is staged through a driver buffer and the host waits for it. The copy is queued behind the
    device's work, and torch's pinned-memory cache keeps the buffer until the copy has run."""
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _chunk_arrays(chunks: list[ScheduledChunk], block_size: int):
    """Token ids, positions, slots, padded block tables and context lengths for some chunks."""
    if not chunks:
        empty = np.zeros(0, dtype=np.int64)
        return [], empty, empty, np.zeros((0, 1), dtype=np.int32), np.zeros(0, dtype=np.int32)
    token_ids: list[int] = []
    positions, slots = [], []
    max_blocks = max(len(c.seq.block_table) for c in chunks)
    block_tables = np.zeros((len(chunks), max_blocks), dtype=np.int32)  # [seqs, max_blocks]
    context_lens = np.empty(len(chunks), dtype=np.int32)
    for row, chunk in enumerate(chunks):
        seq, start = chunk.seq, chunk.seq.num_computed_tokens
        end = start + chunk.num_tokens
        token_ids.extend(chunk.token_ids)
        table = np.asarray(seq.block_table, dtype=np.int64)
        block_tables[row, : len(table)] = table
        pos = np.arange(start, end, dtype=np.int64)
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        context_lens[row] = end
    return token_ids, np.concatenate(positions), np.concatenate(slots), block_tables, context_lens


def prepare_step(sched: SchedulerOutput, block_size: int) -> StepInput:
    """Flatten a scheduled step: decodes first, then prefill chunks, into one token batch."""
    d_ids, d_pos, d_slots, d_tables, d_lens = _chunk_arrays(sched.decodes, block_size)
    p_ids, p_pos, p_slots, p_tables, p_lens = _chunk_arrays(sched.prefills, block_size)
    query_lens = np.array([c.num_tokens for c in sched.prefills], dtype=np.int32)
    query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_decode = len(sched.decodes)
    # the last token of every chunk that completes its sequence is sampled
    sample_indices = [row for row, c in enumerate(sched.decodes) if c.completes_sequence]
    sample_indices += [
        num_decode + int(query_start_loc[row + 1]) - 1
        for row, c in enumerate(sched.prefills)
        if c.completes_sequence
    ]
    if any(c.proposals for c in sched.prefills):
        sample_indices = _speculative_sample_indices(sched, query_start_loc)
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(np.concatenate([d_slots, p_slots])),
        num_decode_tokens=num_decode,
        decode_block_tables=torch.from_numpy(d_tables),
        decode_context_lens=torch.from_numpy(d_lens),
        num_prefill_tokens=int(query_start_loc[-1]),
        prefill_max_query_len=int(query_lens.max()) if len(query_lens) else 0,
        prefill_block_tables=torch.from_numpy(p_tables),
        prefill_query_start_loc=torch.from_numpy(query_start_loc),
        prefill_context_lens=torch.from_numpy(p_lens),
    )
    return StepInput(
        input_ids=torch.tensor(d_ids + p_ids, dtype=torch.int64),
        positions=torch.from_numpy(np.concatenate([d_pos, p_pos])),
        meta=meta,
        sample_indices=torch.tensor(sample_indices, dtype=torch.int64),
        swap_out=sched.swap_out,
        swap_in=sched.swap_in,
        swap_out_ticket=sched.swap_out_ticket,
    )


def profile_step(num_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int) -> StepInput:
    """The largest step the scheduler hands out: `num_tokens` of prefill in sequences of up to max_model_len
    tokens, with up to max_num_seqs rows sampled. It writes no K/V (slot -1) and every block table points at
    block 0, so it runs over a one-block cache before the real cache exists."""
    seq_len = min(num_tokens, max_model_len)
    lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    query_start_loc = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=query_start_loc[1:])
    max_blocks = -(-seq_len // block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
        num_decode_tokens=0,
        decode_block_tables=torch.zeros((0, 1), dtype=torch.int32),
        decode_context_lens=torch.zeros(0, dtype=torch.int32),
        num_prefill_tokens=num_tokens,
        prefill_max_query_len=seq_len,
        prefill_block_tables=torch.zeros((len(lens), max_blocks), dtype=torch.int32),
        prefill_query_start_loc=torch.from_numpy(query_start_loc),
        prefill_context_lens=torch.tensor(lens, dtype=torch.int32),
    )
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens])
    return StepInput(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=positions,
        meta=meta,
        sample_indices=torch.arange(min(max_num_seqs, num_tokens), dtype=torch.int64),
    )


def _speculative_sample_indices(sched: SchedulerOutput, query_start_loc: np.ndarray) -> list[int]:
    """Sampled rows when some chunks verify proposals: every position of those, the last of the others."""
    num_decode = len(sched.decodes)
    indices = [row for row, c in enumerate(sched.decodes) if c.completes_sequence]
    for row, c in enumerate(sched.prefills):
        start, end = num_decode + int(query_start_loc[row]), num_decode + int(query_start_loc[row + 1])
        if c.proposals:
            indices.extend(range(start, end))  # position j samples the token after proposal j
        elif c.completes_sequence:
            indices.append(end - 1)
    return indices


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype, kv_heads_per_rank: int) -> int:
    """K and V of one block across all layers, on one rank."""
    element = torch.empty(0, dtype=dtype).element_size()
    return 2 * model_config.num_hidden_layers * block_size * kv_heads_per_rank * model_config.head_dim * element


class ModelRunner:
    """Holds this rank's weights and KV cache; runs forward passes."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        parallel: ParallelContext | None = None,
        num_blocks: int | None = None,
        max_model_len: int | None = None,
    ):
        from engine.checkpoint.loader import load_model  # heavy: transformers-free but touches safetensors

        self.config = config
        self.model_config = model_config
        self.parallel = parallel or ParallelContext()
        self.device = config.resolved_device()
        self.cpu_cores = config.rank_cpu_cores(self.parallel.rank)  # None: unbound
        self.cpu_threads = config.resolved_cpu_threads(self.parallel.rank)
        self._threads_set_on: int | None = None  # the OS thread whose torch thread count is set
        self._use_cpu_threads()
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())  # the rank's own (its executor set it)
        self.dtype = config.torch_dtype(model_config)
        self.backend = get_backend(config.kernel_backend, self.device.type)
        if self.device.type == "cpu":
            reuse_freed_memory()  # activations from the heap, not fresh mmaps (kernels/host_memory.py)
        self.max_model_len = max_model_len or model_config.max_position_embeddings
        # a GPU's cache is sized from a profile unless its size is given; the card is read before the
        # weights load, since the profile counts from there
        sized_by_profile = num_blocks is None and config.num_kv_blocks is None and config.kv_cache_memory_gb is None
        self._gpu_memory = gpu_memory_for(self.device) if sized_by_profile else None
        self._profiled = False  # the profile step ran (and compiled its kernels)
        memory_at_start = self._read_memory_at_start()
        self.model = load_model(
            config.model, model_config, self.dtype, self.device, self.parallel, self.backend
        )
        # oneDNN's layout on the native CPU path, and the weights as they are beside it for the small-batch kernel
        # where that copy fits (kernels/linear.py)
        pack_linear_weights(self.model, self.backend.pack_linear_weight, keep_dense=self._room_for_a_second_copy())
        self.model.cover_positions(self.max_model_len)  # a rope-scaled context may pass max_position_embeddings
        num_blocks = num_blocks or self._size_kv_cache(memory_at_start)
        # block ids are shared by every rank (one block manager): all hold the smallest rank's count
        self.num_blocks = min_over_ranks(num_blocks, self.parallel)
        shape = (2, self.model.kv_heads_per_rank, self.num_blocks, config.block_size, model_config.head_dim)
        # zeroed: padding positions of gathered blocks must hold finite values (0 * NaN = NaN); on CPU on 2 MiB
        # pages where Linux gives them, since decode reads blocks from anywhere in the cache (kernels/host_memory.py)
        self.kv_caches = [
            zeros_on_huge_pages(shape, self.dtype) if self.device.type == "cpu"
            else torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(model_config.num_hidden_layers)
        ]
        self.swapper = None  # swap preemption's host block pool (engine/swap.py)
        per_block = kv_bytes_per_block(model_config, config.block_size, self.dtype, self.model.kv_heads_per_rank)
        self.num_host_blocks = int(config.swap_space * 2**30) // per_block if config.preemption_mode == "swap" else 0
        if self.num_host_blocks:
            from engine.swap import KVSwapper

            self.swapper = KVSwapper(self.kv_caches, self.num_host_blocks, self.device)
        if self.device.type == "cuda" and self.backend.name == "triton":
            self.warm_up()
        # oneDNN's primitives for the prefill steps' row buckets, built while the engine is idle (engine/warmup.py)
        self.linear_warm_up = (LinearWarmUp(self.model, config.max_num_batched_tokens)
                               if self.device.type == "cpu" else None)

    def _read_memory_at_start(self):
        """The GPU before this engine's weights (None where the cache is not sized from a profile)."""
        if self._gpu_memory is None:
            return None
        self._gpu_memory.release_cached()  # blocks an earlier engine in this process freed are not in use
        at_start = self._gpu_memory.read()
        check_share_is_free(at_start, self.config.gpu_memory_utilization)
        return at_start

    def _room_for_a_second_copy(self) -> bool:
        """Whether a second copy of the loaded weights takes at most a quarter of the memory still free (CPU)."""
        if self.device.type != "cpu":
            return False
        free = available_memory_bytes()
        return free is not None and weight_bytes(self.model) <= free // 4

    def _size_kv_cache(self, memory_at_start) -> int:
        """How many KV blocks this rank holds: num_kv_blocks, else kv_cache_memory_gb, else on a GPU what
        gpu_memory_utilization leaves after a profiled forward pass, else (CPU) a fixed budget."""
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = kv_bytes_per_block(self.model_config, config.block_size, self.dtype, self.model.kv_heads_per_rank)
        if config.kv_cache_memory_gb is not None:
            return max(1, int(config.kv_cache_memory_gb * GIB) // per_block)
        if memory_at_start is not None:
            self._gpu_memory.reset_peak()
            self.run_profile_step()
            self._profiled = True
            budget = kv_cache_budget(memory_at_start, self._gpu_memory.read(), config.gpu_memory_utilization)
            self._gpu_memory.release_cached()  # the profile's activations go back to the card for the cache
            if budget.kv_cache < per_block:
                raise KVCacheMemoryError(
                    f"no room for the KV cache on rank {self.parallel.rank}: {budget.describe()}; raise "
                    "gpu_memory_utilization, lower max_num_batched_tokens or max_num_seqs, or use more ranks"
                )
            return budget.kv_cache // per_block
        # CPU: a fixed budget, no more than every sequence at full length would need
        full = config.max_num_seqs * -(-self.max_model_len // config.block_size)
        return max(1, min(int(_CPU_DEFAULT_KV_GB * GIB) // per_block, full))

    @torch.inference_mode()
    def run_profile_step(self) -> None:
        """One forward pass at the step's token budget over a one-block cache, then the sampler over as many
        rows as a step samples: the peak the KV sizing leaves room for."""
        config = self.config
        step = profile_step(config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len, config.block_size)
        shape = (2, self.model.kv_heads_per_rank, 1, config.block_size, self.model_config.head_dim)
        layers = self.model_config.num_hidden_layers
        caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(layers)]
        step = step.to(self.device)
        hidden = self.model(step.input_ids, step.positions, caches, step.meta)
        logits = self.model.compute_logits(hidden.index_select(0, step.sample_indices))
        warm_up_sampling(self.backend, logits)

    def warm_up(self) -> None:
        """Compile every Triton variant a step can need before the first request (engine/warmup.py): the
        profile step's kernels, paged attention's variants, the sampler and the grammar mask."""
        if not self._profiled:
            self.run_profile_step()
        warm_up_attention(
            self.backend, self.kv_caches[0], self.model.model.layers[0].self_attn.num_heads, self.max_model_len,
            self.config.max_num_seqs,
        )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def warm_up_idle(self) -> bool:
        """One unit of the idle warm-up (engine/warmup.py LinearWarmUp); whether any is left."""
        if self.linear_warm_up is None or self.linear_warm_up.done:
            return False
        self._use_cpu_threads()
        return self.linear_warm_up.step()

    @torch.inference_mode()
    def _use_cpu_threads(self) -> None:
        """Under OpenMP torch's thread count belongs to the calling OS thread, and a new thread starts
        from OMP_NUM_THREADS (Ray sets it to an actor's logical CPUs, 1 per rank): so it is set on
        whichever thread runs the steps (the async engine's loop thread), once."""
        if self.device.type == "cpu" and self._threads_set_on != threading.get_ident():
            torch.set_num_threads(self.cpu_threads)
            if self.cpu_cores:
                bind_threads(self.cpu_cores)
            self._threads_set_on = threading.get_ident()

    def execute_model(self, step: StepInput, sampling: SamplingBatch | None = None) -> list[SampledToken] | None:
        """One forward pass; on rank 0 (`sampling` given) one sampled token per sampled sequence, else None."""
        logits = self.compute_logits(step)
        if sampling is None or logits is None:
            return None
        bitmask = sampling.grammar_bitmask.result() if sampling.grammar_bitmask is not None else None
        return sample(logits, sampling.seqs, sampling.eos_token_ids, self.backend, bitmask)

    def compute_logits(self, step: StepInput) -> torch.Tensor | None:
        """The forward pass: [num_sampled, vocab] float32 logits, or None if nothing is sampled."""
        self._use_cpu_threads()
        if self.swapper is not None:
            self.swapper.before_step(
                step.swap_out, step.swap_in, step.swap_out_ticket, step.meta.slot_mapping, self.config.block_size
            )
        if step.input_ids.numel() == 0:
            return None  # a step of swap copies only
        step = step.to(self.device)
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta)
        if step.sample_indices.numel() == 0:
            return None
        return self.model.compute_logits(hidden.index_select(0, step.sample_indices))

    def poll_swap_outs(self) -> list[int]:
        """Tickets of swap-outs finished since the last poll; their device blocks may be reused."""
        return self.swapper.poll() if self.swapper is not None else []

    def wait_swap_outs(self) -> list[int]:
        """Block until every swap-out in flight finished (when nothing else can run); their tickets."""
        return self.swapper.wait_all() if self.swapper is not None else []

    def shutdown(self) -> None:
        """Stop the swap-out thread (after its copies in flight); the rest goes with the object."""
        if self.swapper is not None:
            self.swapper.shutdown()
