"""Tensor-parallel layers (Megatron / vLLM style) and how each cuts its shard from a checkpoint.

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)`. `loaded_weight` is
the *full* checkpoint tensor: a torch tensor, or a safetensors slice (`safe_open(...).get_slice`),
which is only ever indexed with this rank's range, so a rank reads just its shard from disk.

Column-parallel layers split output features across ranks (no communication); row-parallel
layers split input features and all-reduce their partial sums. Attention heads therefore live
whole on one rank: query heads are split evenly, KV heads too, or replicated when there are
more ranks than KV heads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.linear import PackedLinearWeight, linear
from parallel.comm import all_gather, all_reduce
from parallel.state import ParallelContext

CheckpointTensor = Any  # torch.Tensor or a safetensors slice (has get_shape() and [a:b] indexing)


class ShardShapeError(ValueError):
    """A checkpoint tensor's full shape is not the one the model was built for."""


def checkpoint_shape(loaded_weight: CheckpointTensor) -> tuple[int, ...]:
    """The full shape of a checkpoint tensor without reading its data."""
    if hasattr(loaded_weight, "get_shape"):
        return tuple(loaded_weight.get_shape())
    return tuple(loaded_weight.shape)


def _check_shape(loaded_weight: CheckpointTensor, expected: tuple[int, ...]) -> None:
    shape = checkpoint_shape(loaded_weight)
    if shape != tuple(expected):
        raise ShardShapeError(f"checkpoint shape {list(shape)} does not match the model's {list(expected)}")


def _read_rows(loaded_weight: CheckpointTensor, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) along dim 0 (works for 1-D biases too); reads only those rows."""
    return loaded_weight[start:end]


def _read_all(loaded_weight: CheckpointTensor) -> torch.Tensor:
    return loaded_weight[:]


def _new_parameter(shape: tuple[int, ...], dtype: torch.dtype | None, weight_loader) -> nn.Parameter:
    """Uninitialised (torch.empty) inference parameter: the loader fills it."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype or torch.get_default_dtype()), requires_grad=False)
    param.weight_loader = weight_loader
    return param


def replicated_weight_loader(param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id=None) -> None:
    """For tensors every rank holds whole (norm weights)."""
    _check_shape(loaded_weight, tuple(param.shape))
    param.data.copy_(_read_all(loaded_weight))


def _split_evenly(size: int, world_size: int, what: str) -> int:
    if size % world_size:
        raise ValueError(f"{what} ({size}) is not divisible by the tensor-parallel size ({world_size})")
    return size // world_size


def _matmul(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ bias) with the layer's weight, or the packed copy its kernel backend gave it."""
    return linear(x, layer.weight, bias, layer.packed_weight)


def pack_linear_weights(model: nn.Module, pack: Callable[..., PackedLinearWeight | None],
                        keep_dense: bool = False) -> int:
    """Give every linear layer (and the LM head) the packed copy of its weight that `pack` (the kernel
    backend's `pack_linear_weight`) makes, if it makes one. A packed linear layer's dense weight is then
    released (not the LM head's, which a tied embedding may share), unless `keep_dense` lets the packed copy
    hold it too (for the small-batch kernel: twice the memory). Returns the layers packed."""
    count = 0
    for module in model.modules():
        if not isinstance(module, (_OutputShardedLinear, RowParallelLinear, ParallelLMHead)):
            continue
        is_head = isinstance(module, ParallelLMHead)
        packed = pack(module.weight, keep_dense=keep_dense, weight_stays=is_head)  # the head's dense weight stays
        if packed is None:
            continue
        module.packed_weight = packed
        if not is_head:
            module.weight.data = torch.empty(0, dtype=module.weight.dtype)
        count += 1
    return count


def _released_packed_weights(model: nn.Module) -> list[PackedLinearWeight]:
    """The packed copies that stand in for a dense weight their layer released (not the LM head's)."""
    return [module.packed_weight for module in model.modules()
            if getattr(module, "packed_weight", None) is not None and module.weight.numel() == 0]


def dense_copy_bytes(model: nn.Module) -> int:
    """Bytes of the second copies of packed linear weights that the small-batch kernels read (the dense weight, or its
    AMX tiles), not counting a copy that is the layer's own weight (the LM head's dense weight: weight_bytes has it)."""
    total = 0
    for module in model.modules():
        packed = getattr(module, "packed_weight", None)
        if packed is None or packed.dense is None:
            continue
        if module.weight.numel() and packed.dense.data_ptr() == module.weight.data_ptr():
            continue
        total += packed.dense_copy_bytes
    return total


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights, each counted once (a tied head too): a packed layer's packed copy
    stands in for the dense weight it released. (The LM head keeps both copies; counted once.)"""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total + sum(packed.nbytes for packed in _released_packed_weights(model))


class _OutputShardedLinear(nn.Module):
    """Base of the column-parallel layers: weight [out_per_rank, in], optional bias [out_per_rank]."""

    def __init__(self, input_size: int, out_per_rank: int, bias: bool, dtype: torch.dtype | None):
        super().__init__()
        self.input_size = input_size
        self.out_per_rank = out_per_rank
        self.weight = _new_parameter((out_per_rank, input_size), dtype, self.weight_loader)
        self.bias = _new_parameter((out_per_rank,), dtype, self.weight_loader) if bias else None
        self.packed_weight: PackedLinearWeight | None = None  # see pack_linear_weights

    def _load_rows(
        self,
        param: nn.Parameter,
        loaded_weight: CheckpointTensor,
        full_rows: int,
        src_start: int,
        dst_start: int,
        rows: int,
    ) -> None:
        """Copy checkpoint rows [src_start, src_start + rows) into param rows [dst_start, ...)."""
        _check_shape(loaded_weight, (full_rows, *param.shape[1:]))
        param.data[dst_start : dst_start + rows].copy_(_read_rows(loaded_weight, src_start, src_start + rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out_per_rank]
        return _matmul(self, x, self.bias)


class ColumnParallelLinear(_OutputShardedLinear):
    """y = x W^T + b with W's output rows split across ranks; each rank returns its slice of y."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        parallel: ParallelContext,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(
            input_size, _split_evenly(output_size, parallel.world_size, "output size"), bias, dtype
        )
        self.parallel = parallel
        self.output_size = output_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id=None) -> None:
        start = self.parallel.rank * self.out_per_rank
        self._load_rows(param, loaded_weight, self.output_size, start, 0, self.out_per_rank)


class MergedColumnParallelLinear(_OutputShardedLinear):
    """Several column-parallel linears sharing one input, fused: per rank [shard_0 || shard_1 || ...].

    The gated MLP fuses gate_proj (shard_id 0) and up_proj (shard_id 1).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        parallel: ParallelContext,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ):
        sizes_per_rank = [_split_evenly(s, parallel.world_size, "output size") for s in output_sizes]
        super().__init__(input_size, sum(sizes_per_rank), bias, dtype)
        self.parallel = parallel
        self.output_sizes = list(output_sizes)
        self.sizes_per_rank = sizes_per_rank

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | None = None
    ) -> None:
        if shard_id is None or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be one of 0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        rows = self.sizes_per_rank[shard_id]
        dst_start = sum(self.sizes_per_rank[:shard_id])
        src_start = self.parallel.rank * rows
        self._load_rows(param, loaded_weight, self.output_sizes[shard_id], src_start, dst_start, rows)


class QKVParallelLinear(_OutputShardedLinear):
    """q_proj, k_proj and v_proj fused; each rank holds whole heads: per rank [q || k || v].

    Query heads split evenly. KV heads split evenly when there are at least as many as ranks;
    otherwise each KV head is replicated on tp / num_kv_heads consecutive ranks (vLLM's rule),
    so rank r serves KV head r // (tp / num_kv_heads).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        parallel: ParallelContext,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ):
        tp = parallel.world_size
        heads_per_rank = _split_evenly(num_heads, tp, "num_attention_heads")
        if tp >= num_kv_heads:
            if tp % num_kv_heads:
                raise ValueError(
                    f"tensor-parallel size ({tp}) is not a multiple of num_key_value_heads ({num_kv_heads})"
                )
            kv_heads_per_rank, first_kv_head = 1, parallel.rank // (tp // num_kv_heads)
        else:
            kv_heads_per_rank = _split_evenly(num_kv_heads, tp, "num_key_value_heads")
            first_kv_head = parallel.rank * kv_heads_per_rank
        super().__init__(hidden_size, (heads_per_rank + 2 * kv_heads_per_rank) * head_dim, bias, dtype)
        self.parallel = parallel
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.heads_per_rank = heads_per_rank
        self.kv_heads_per_rank = kv_heads_per_rank
        self.first_kv_head = first_kv_head  # this rank's first KV head in the checkpoint
        self.q_size = heads_per_rank * head_dim
        self.kv_size = kv_heads_per_rank * head_dim

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: str | None = None
    ) -> None:
        if shard_id == "q":
            full_rows, src_start, rows = (
                self.num_heads * self.head_dim,
                self.parallel.rank * self.q_size,
                self.q_size,
            )
            dst_start = 0
        elif shard_id in ("k", "v"):
            full_rows, src_start, rows = (
                self.num_kv_heads * self.head_dim,
                self.first_kv_head * self.head_dim,
                self.kv_size,
            )
            dst_start = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        self._load_rows(param, loaded_weight, full_rows, src_start, dst_start, rows)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[num_tokens, q + 2 kv] -> q [num_tokens, q_size], k and v [num_tokens, kv_size]."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split across ranks: partial sums are all-reduced,
    then the (unsplit) bias is added once."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        parallel: ParallelContext,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.parallel = parallel
        self.input_size = input_size
        self.output_size = output_size
        self.in_per_rank = _split_evenly(input_size, parallel.world_size, "input size")
        self.weight = _new_parameter((output_size, self.in_per_rank), dtype, self.weight_loader)
        self.bias = _new_parameter((output_size,), dtype, self.weight_loader) if bias else None
        self.packed_weight: PackedLinearWeight | None = None  # see pack_linear_weights

    def weight_loader(self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id=None) -> None:
        if param is self.bias:
            _check_shape(loaded_weight, (self.output_size,))
            param.data.copy_(_read_all(loaded_weight))
            return
        _check_shape(loaded_weight, (self.output_size, self.input_size))
        start = self.parallel.rank * self.in_per_rank
        param.data.copy_(loaded_weight[:, start : start + self.in_per_rank])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in_per_rank] -> [num_tokens, out]
        if self.parallel.world_size == 1:
            return _matmul(self, x, self.bias)
        y = all_reduce(_matmul(self, x, None), self.parallel)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks.

    The vocabulary is padded to a multiple of tp; rank r owns ids [vocab_start, vocab_end) in the
    first rows of its [vocab_per_rank, hidden] shard, and zero rows for the padding. Each rank
    embeds the ids it owns, zeros the rest, and the all-reduce assembles the full embedding.
    """

    def __init__(
        self, vocab_size: int, hidden_size: int, parallel: ParallelContext, dtype: torch.dtype | None = None
    ):
        super().__init__()
        tp = parallel.world_size
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.padded_vocab_size = -(-vocab_size // tp) * tp
        self.vocab_per_rank = self.padded_vocab_size // tp
        self.vocab_start = min(parallel.rank * self.vocab_per_rank, vocab_size)
        self.vocab_end = min(self.vocab_start + self.vocab_per_rank, vocab_size)
        self.weight = _new_parameter((self.vocab_per_rank, hidden_size), dtype, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id=None) -> None:
        _check_shape(loaded_weight, (self.vocab_size, self.hidden_size))
        rows = self.vocab_end - self.vocab_start
        if rows:
            param.data[:rows].copy_(_read_rows(loaded_weight, self.vocab_start, self.vocab_end))
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        if self.parallel.world_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # [num_tokens]
        local_ids = (input_ids - self.vocab_start).masked_fill(~owned, 0)
        embedded = F.embedding(local_ids, self.weight).masked_fill(~owned[:, None], 0)
        return all_reduce(embedded, self.parallel)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection to vocabulary logits, sharded like VocabParallelEmbedding (so a tied
    head can share the embedding's shard). forward: hidden -> logits over the full vocabulary."""

    packed_weight: PackedLinearWeight | None = None  # see pack_linear_weights

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab_size]
        local_logits = _matmul(self, hidden, None)  # [n, vocab_per_rank]
        logits = all_gather(local_logits, self.parallel, dim=-1)  # [n, padded_vocab_size]
        return logits[:, : self.vocab_size]
