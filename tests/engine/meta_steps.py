"""Steps of the GPU path run on the meta device (shapes and dtypes, no data, no GPU): the model built with the
Triton backend, whose launches kernels/triton_variants.py records instead of running, and every aten op
counted as a TorchDispatchMode sees it. A host sync (`.item()`, `.tolist()`, `bool(tensor)`) cannot run on
meta tensors, so a forward pass that needs one fails here."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine.attention import AttentionMetadata
from engine.config import EngineConfig, ModelConfig
from engine.model_runner import ModelRunner, StepInput
from engine.models import model_class_for
from kernels.backend import get_backend
from kernels.triton_variants import record_launches
from parallel.state import ParallelContext

META = torch.device("meta")
aten = torch.ops.aten
# aten ops that launch nothing on a GPU: allocations (views are recognised by their schema, and ops that return
# no tensor, such as promote_types, are not counted)
NO_LAUNCH = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.lift_fresh.default,
             aten._unsafe_view.default}

# Llama 3 8B's shape: 32 layers, hidden 4096, 32 query heads over 8 KV heads, vocabulary 128,256
LLAMA_8B = ModelConfig(
    architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_theta=500000.0,
)


class DeviceWork(TorchDispatchMode):
    """Counts the aten ops that launch a kernel, and notes every op given a CPU tensor (a host copy)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.cpu_inputs: list[str] = []
        self.largest_cpu_tensor = 0  # elements of the largest CPU tensor any op took or made

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cpu = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.device.type == "cpu"]
        if any(x.dim() > 0 for x in cpu):
            self.cpu_inputs.append(str(func))
        out = func(*args, **kwargs)
        cpu += [x for x in tree_leaves(out) if isinstance(x, torch.Tensor) and x.device.type == "cpu"]
        self.largest_cpu_tensor = max([self.largest_cpu_tensor, *(x.numel() for x in cpu)])
        # `to` may return its input (no launch) or a converted copy (one), so its schema says "may alias"
        copies = func.overloadpacket is aten.to and out is not args[0]
        launches = not func.is_view and func not in NO_LAUNCH and any(isinstance(x, torch.Tensor) for x in tree_leaves(out))
        if launches or copies:
            self.ops[func.overloadpacket.__name__] += 1
        return out


class MetaEngine:
    """A model of `config` on the meta device with the Triton backend and a meta KV cache."""

    def __init__(self, config: ModelConfig, num_blocks: int = 4096, block_size: int = 16, dtype=torch.bfloat16):
        self.config, self.block_size = config, block_size
        self.backend = get_backend("triton", "cuda")
        with torch.device(META):
            self.model = model_class_for(config)(config, ParallelContext(), self.backend, dtype=dtype)
            shape = (2, config.num_key_value_heads, num_blocks, block_size, config.head_dim)
            self.kv_caches = [torch.empty(shape, dtype=dtype) for _ in range(config.num_hidden_layers)]

    @staticmethod
    def on_device(step: StepInput) -> tuple[StepInput, tuple[torch.Tensor, ...]]:
        """The step as ModelRunner moves it (StepInput.to), and the fused sampler's per-row inputs."""
        rows = step.sample_indices.numel()
        sampler_inputs = (torch.ones(rows), torch.zeros(rows, dtype=torch.int32), torch.ones(rows),
                          torch.zeros(rows), torch.zeros(rows, dtype=torch.float64))
        return step.to(META), tuple(x.to(META) for x in sampler_inputs)

    @torch.inference_mode()
    def forward(self, step: StepInput, sampler_inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The runner's compute_logits on a step already on the device, then the fused sampler over its rows."""
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta)
        logits = self.model.compute_logits(hidden.index_select(0, step.sample_indices))
        self.backend.sample_tokens(logits, *sampler_inputs)
        return logits

    def warm_up(self, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> None:
        """ModelRunner.warm_up itself (what a GPU engine runs at start-up), on this meta model: the runner's
        fields it reads are set here rather than by loading a checkpoint."""
        runner = object.__new__(ModelRunner)
        runner.config = EngineConfig(model="meta", block_size=self.block_size, max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=max_num_batched_tokens)
        runner.model_config, runner.model, runner.backend = self.config, self.model, self.backend
        runner.device, runner.dtype, runner.max_model_len = META, self.kv_caches[0].dtype, max_model_len
        runner.kv_caches, runner._profiled = self.kv_caches, False
        runner.warm_up()


@contextmanager
def recorded():
    """(DeviceWork, Triton launches) of the code run inside."""
    work = DeviceWork()
    with record_launches() as launches, work:
        yield work, launches


def step_of(decode_contexts: list[int], prefills: list[tuple[int, int]], block_size: int = 16) -> StepInput:
    """A step of decodes (one token each, their context lengths) and prefill chunks ((query_len, context_len)),
    each sequence in blocks of its own, every completed sequence sampled."""
    next_block = 0

    def table(context: int) -> list[int]:
        nonlocal next_block
        blocks = list(range(next_block, next_block + -(-context // block_size)))
        next_block += len(blocks)
        return blocks

    def padded(tables: list[list[int]]) -> torch.Tensor:
        width = max((len(t) for t in tables), default=1)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).view(len(tables), width)

    decode_tables = [table(c) for c in decode_contexts]
    prefill_tables = [table(c) for _, c in prefills]
    positions = [c - 1 for c in decode_contexts] + [p for q, c in prefills for p in range(c - q, c)]
    tables = decode_tables + prefill_tables
    firsts = [c - 1 for c in decode_contexts] + [c - q for q, c in prefills]
    counts = [1] * len(decode_contexts) + [q for q, _ in prefills]
    slots = [t[p // block_size] * block_size + p % block_size
             for t, first, n in zip(tables, firsts, counts) for p in range(first, first + n)]
    query_start_loc = [0]
    for q, _ in prefills:
        query_start_loc.append(query_start_loc[-1] + q)
    num_decode = len(decode_contexts)
    return StepInput(
        input_ids=torch.zeros(len(positions), dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        meta=AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_decode_tokens=num_decode,
            decode_block_tables=padded(decode_tables),
            decode_context_lens=torch.tensor(decode_contexts, dtype=torch.int32),
            num_prefill_tokens=query_start_loc[-1],
            prefill_max_query_len=max((q for q, _ in prefills), default=0),
            prefill_block_tables=padded(prefill_tables),
            prefill_query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            prefill_context_lens=torch.tensor([c for _, c in prefills], dtype=torch.int32),
        ),
        sample_indices=torch.tensor(list(range(num_decode)) + [num_decode + e - 1 for e in query_start_loc[1:]],
                                    dtype=torch.int64),
    )
