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


def test_the_engine_keeps_dense_copies_for_the_small_batch_kernel_only_where_a_second_copy_fits(
        tiny_llama_dir, monkeypatch):
    """With memory to spare the released linear weights are held twice (every build with vector code has the kernel);
    greedy tokens are those of the packed products alone."""
    from engine import LLM, SamplingParams
    from kernels import cpu_native

    assert cpu_native.load().vector_isa() != "scalar"
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 14, 3], [7, 7, 2]]
    results = {}
    for free in (1 << 40, 1 << 20):
        monkeypatch.setattr("engine.model_runner.available_memory_bytes", lambda free=free: free)
        llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=128, kernel_backend="cpu")
        try:
            (memory,) = llm.engine.executor.memory()
            runner = llm.engine.executor._live_runner()
            released = sum(m.packed_weight.nbytes for m in runner.model.modules()
                           if getattr(m, "packed_weight", None) is not None and m.weight.numel() == 0)
            tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy)]
        finally:
            llm.shutdown()
        results[free] = (memory.dense_copy_bytes, released, tokens)
    (kept, released, with_copies), (none, _, packed_only) = results[1 << 40], results[1 << 20]
    assert released > 0 and kept == released and none == 0
    assert with_copies == packed_only
