"""Packed linear weights (kernels/linear.py, oneDNN on CPU): same products as F.linear, dense copies released,
bytes counted once."""

import pytest
import torch
import torch.nn.functional as F

from kernels.linear import PackedLinearWeight, no_packing, pack_for_onednn
from parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    pack_linear_weights,
    weight_bytes,
)
from parallel.state import ParallelContext


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs weights of this dtype (bfloat16 needs AVX-512 or AVX-NE-CONVERT)."""
    try:
        PackedLinearWeight(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True


def test_a_weight_onednn_cannot_pack_is_left_as_it_is(monkeypatch):
    def refuse(self, weight, small_batch=None, split_rows=None):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    monkeypatch.setattr(PackedLinearWeight, "__init__", refuse)
    assert pack_for_onednn(torch.zeros(8, 8, dtype=torch.bfloat16)) is None
    with pytest.raises(RuntimeError):  # float32 always packs: a failure there is a real one
        pack_for_onednn(torch.zeros(8, 8, dtype=torch.float32))


def filled(module, generator):
    for param in module.parameters():
        param.data.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return module


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_layers_compute_what_f_linear_computes(dtype):
    generator = torch.Generator().manual_seed(0)
    parallel = ParallelContext()
    model = torch.nn.ModuleDict(
        {
            "up": filled(MergedColumnParallelLinear(64, [96, 96], parallel, dtype=dtype), generator),
            "down": filled(RowParallelLinear(96, 64, parallel, bias=True, dtype=dtype), generator),
            "head": filled(ParallelLMHead(300, 64, parallel, dtype=dtype), generator),
        }
    )
    dense = {name: module.weight.detach().clone() for name, module in model.items()}
    bias = model["down"].bias.detach().clone()
    before = weight_bytes(model)
    x = torch.randn(7, 64, generator=generator).to(dtype)
    h = torch.randn(7, 96, generator=generator).to(dtype)

    if not onednn_packs(dtype):  # bfloat16 on a CPU without AVX-512: left dense, F.linear multiplies it
        assert pack_linear_weights(model, pack_for_onednn) == 0
        assert torch.equal(model["down"](h), F.linear(h, dense["down"], bias))
        return
    assert pack_linear_weights(model, pack_for_onednn) == 3

    assert model["up"].weight.numel() == 0 and model["down"].weight.numel() == 0  # released
    assert model["head"].weight.shape == (300, 64)  # a tied embedding may share it: kept
    assert weight_bytes(model) == before
    exact = dtype == torch.bfloat16  # float32's summation order differs in the last bits
    for got, want in [
        (model["up"](x), F.linear(x, dense["up"])),
        (model["down"](h), F.linear(h, dense["down"], bias)),
        (model["head"](x), F.linear(x, dense["head"])),
    ]:
        if exact:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_backend_without_packing_leaves_every_layer_dense():
    parallel = ParallelContext()
    layer = RowParallelLinear(16, 8, parallel, dtype=torch.float32)
    assert pack_linear_weights(layer, no_packing) == 0
    assert layer.packed_weight is None and layer.weight.shape == (8, 16)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_keeps_second_copies_for_the_small_batch_kernels_only_where_they_fit(tiny_llama_dir, monkeypatch,
                                                                                         dtype):
    """With memory to spare the released linear weights are held twice (every build with vector code has the kernels;
    bfloat16 on AMX: as tiles). float32: greedy tokens are those of the packed products alone. bfloat16: the two
    products round differently in the last bit, so the top logprobs agree to bfloat16's precision, and the tokens do
    until a near tie (top two within it) goes the other way."""
    from engine import LLM, SamplingParams
    from kernels import cpu_native

    assert cpu_native.load().vector_isa() != "scalar"
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [[5, 9, 14, 3], [7, 7, 2]]
    results = {}
    for free in (1 << 40, 1 << 20):
        monkeypatch.setattr("engine.model_runner.available_memory_bytes", lambda free=free: free)
        llm = LLM(model=str(tiny_llama_dir), dtype=dtype, max_model_len=128, kernel_backend="cpu")
        try:
            (memory,) = llm.engine.executor.memory()
            runner = llm.engine.executor._live_runner()
            released = [m.packed_weight for m in runner.model.modules()
                        if getattr(m, "packed_weight", None) is not None and m.weight.numel() == 0]
            outputs = [out.outputs[0] for out in llm.generate(prompts, greedy)]
        finally:
            llm.shutdown()
        results[free] = (memory.dense_copy_bytes, released, outputs)
    (kept, released, with_copies), (none, _, packed_only) = results[1 << 40], results[1 << 20]
    assert none == 0
    if not released:  # bfloat16 where oneDNN cannot pack it (AVX2 alone): nothing packed, nothing copied
        assert dtype == "bfloat16" and kept == 0
        return
    # (the LM head's tiles, where it has them, count too: its dense weight stays, but tiles are a copy of their own)
    assert kept >= sum(packed.dense_copy_bytes for packed in released) >= sum(packed.nbytes for packed in released)
    if dtype == "float32":
        assert kept == sum(packed.nbytes for packed in released)
        assert [out.token_ids for out in with_copies] == [out.token_ids for out in packed_only]
        return
    for a, b in zip(with_copies, packed_only, strict=True):
        for token_a, token_b, top_a, top_b in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs, strict=True):
            for token in top_a.keys() & top_b.keys():
                assert abs(top_a[token] - top_b[token]) < 0.05
            if token_a != token_b:
                first, second = sorted(top_b.values(), reverse=True)[:2]
                assert first - second < 0.05  # a near tie: from here on the sequences differ
                break
