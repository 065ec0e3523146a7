"""oneDNN's packed bfloat16 products, rows cut over the threads where that is faster (kernels/linear.py
SplitRowsChoice, kernels/cpu/linear.cpp packed_linear_split_rows)."""

import pytest
import torch
import torch.nn.functional as F

from kernels import linear as linear_module
from kernels.linear import EXACT_ROWS_MAX, SPLIT_ROWS_MAX, PackedLinearWeight, SplitRowsChoice, padded_rows
from tests.parallel.test_packed_weights import onednn_packs

pytestmark = pytest.mark.skipif(not onednn_packs(torch.bfloat16), reason="this CPU's oneDNN packs no bfloat16")


@pytest.mark.parametrize("rows", [1, 3, 300, 513, 1000])
def test_split_product_computes_the_product(native_target, rows):
    """Each thread's part of the rows is oneDNN's product of those rows: the same as the whole product up to the
    last bit of a few outputs, and F.linear's within bfloat16 rounding; the bias is added; odd row counts and
    fewer rows than threads keep every row."""
    from kernels import cpu_native

    native = cpu_native.load(native_target)
    torch.manual_seed(rows)
    weight, bias = torch.randn(200, 96).to(torch.bfloat16), torch.randn(200).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    x = torch.randn(rows, 96).to(torch.bfloat16)

    out = native.packed_linear_split_rows(x, packed, bias)

    assert out.shape == (rows, 200) and out.dtype == torch.bfloat16
    whole = linear_module.onednn_linear(x, packed, bias)
    assert (out != whole).float().mean() < 0.01
    torch.testing.assert_close(out.float(), whole.float(), rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(out.double(), F.linear(x.double(), weight.double(), bias.double()), rtol=5e-2,
                               atol=0.4)
    without_bias = native.packed_linear_split_rows(x, packed)
    torch.testing.assert_close(without_bias.float(), (whole - bias).float(), rtol=2e-2, atol=0.1)


def test_split_product_keeps_every_row_with_more_threads_than_parts(native_target):
    """5 rows on 4 threads are 3 parts (2, 2, 1): no part starts past the rows."""
    from kernels import cpu_native

    native = cpu_native.load(native_target)
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(64, 32).to(torch.bfloat16))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        for rows in (1, 5, 7):
            x = torch.randn(rows, 32).to(torch.bfloat16)
            out = native.packed_linear_split_rows(x, packed)
            torch.testing.assert_close(out.float(), linear_module.onednn_linear(x, packed, None).float(), rtol=2e-2,
                                       atol=5e-2)
    finally:
        torch.set_num_threads(threads)


def test_each_shape_and_bucket_is_decided_once():
    """The first product of a (shape, dtype, rows) times both ways and records the choice; later ones run the
    chosen way only, once; another row count or shape is decided on its own."""
    calls = {"split": 0, "onednn": 0}
    product = linear_module.onednn_linear

    def split(x, packed, bias=None):
        calls["split"] += 1
        return product(x, packed, bias)

    choice = SplitRowsChoice(split)
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(64, 32).to(torch.bfloat16))
    x = torch.randn(272, 32).to(torch.bfloat16)
    first = choice.matmul(x, packed, None)
    assert calls["split"] == 3 and list(choice.choices) == [((64, 32), torch.bfloat16, 272)]
    chosen = choice.choices[((64, 32), torch.bfloat16, 272)]
    again = choice.matmul(x, packed, None)
    assert calls["split"] == 3 + chosen
    torch.testing.assert_close(first, again)
    choice.matmul(torch.randn(304, 32).to(torch.bfloat16), packed, None)
    assert len(choice.choices) == 2


def test_packed_weight_asks_the_choice_only_for_bfloat16_buckets(monkeypatch):
    """Up to EXACT_ROWS_MAX rows and above SPLIT_ROWS_MAX oneDNN runs the product as it is; in between the
    bucket's choice does; float32 weights never ask; SHARDSERVE_LINEAR_SPLIT_ROWS=0 keeps every product whole."""
    asked: list[int] = []

    class Recording(SplitRowsChoice):
        def matmul(self, x, packed, bias):
            asked.append(x.shape[0])
            return linear_module.onednn_linear(x, packed, bias)

    recording = Recording(linear_module.onednn_linear)
    weight = torch.randn(48, 32)
    packed_bf16 = PackedLinearWeight(weight.to(torch.bfloat16), split_rows=recording)
    for rows in (EXACT_ROWS_MAX, EXACT_ROWS_MAX + 1, 700, SPLIT_ROWS_MAX, SPLIT_ROWS_MAX + 1):
        out = packed_bf16.matmul(torch.randn(rows, 32).to(torch.bfloat16), None)
        assert out.shape == (rows, 48)
    assert asked == [padded_rows(EXACT_ROWS_MAX + 1), padded_rows(700), SPLIT_ROWS_MAX]
    PackedLinearWeight(weight, split_rows=recording).matmul(torch.randn(700, 32), None)
    assert len(asked) == 3
    monkeypatch.setattr(linear_module, "SPLIT_ROWS", False)
    PackedLinearWeight(weight.to(torch.bfloat16), split_rows=recording).matmul(
        torch.randn(700, 32).to(torch.bfloat16), None)
    assert len(asked) == 3


def test_idle_warm_up_builds_each_shape_at_each_bucket_largest_first(tiny_llama_dir, monkeypatch):
    """The idle warm-up (engine/warmup.py LinearWarmUp) runs one product per packed shape (the LM head left out) at
    each row bucket above EXACT_ROWS_MAX up to the step budget, one product a step, largest bucket first; switched
    off it has nothing to do."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.warmup import LinearWarmUp
    from parallel.layers import ParallelLMHead

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16", max_num_batched_tokens=600))
    try:
        model = engine.executor.runner.model
        shapes = {tuple(m.packed_weight.packed.shape) for m in model.modules()
                  if getattr(m, "packed_weight", None) is not None and not isinstance(m, ParallelLMHead)}
        seen: list[tuple[int, tuple]] = []
        product = linear_module.onednn_linear

        def recording(x, packed, bias):
            seen.append((x.shape[0], tuple(packed.shape)))
            return product(x, packed, bias)

        monkeypatch.setattr(linear_module, "onednn_linear", recording)
        warm_up = LinearWarmUp(model, 600)
        buckets = sorted({padded_rows(rows) for rows in range(EXACT_ROWS_MAX + 1, 601)})
        assert shapes and len(warm_up.units) == len(buckets) * len(shapes)
        steps = 1
        while warm_up.step():
            steps += 1
        assert steps == len(buckets) * len(shapes) == warm_up.products and warm_up.done
        order = [rows for i, (rows, _) in enumerate(seen) if i == 0 or seen[i - 1][0] != rows]
        assert order == buckets[::-1]  # largest first (a bucket's split decisions run oneDNN's product more than once)
        assert {(rows, shape) for rows, shape in seen} == {(rows, shape) for rows in buckets for shape in shapes}
        monkeypatch.setenv("SHARDSERVE_LINEAR_WARMUP", "0")
        assert LinearWarmUp(model, 600).done
        while engine.warm_up_idle():  # the runner's own, from the engine (the async engine's loop calls it idle)
            pass
        assert engine.executor.runner.linear_warm_up.done and not engine.warm_up_idle()
    finally:
        engine.shutdown()
