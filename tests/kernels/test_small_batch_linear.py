"""The native small-batch linear products (kernels/cpu/linear.cpp): x W^T (+ b) for a few float32 or bfloat16 rows, on
the weight as it is (vector code) and on the weight laid out as AMX tiles, against float64; and which products a
build's packer hands them."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from native_builds import NATIVE_BACKENDS, TARGETS, amx_tiles_expected

from kernels import cpu_native
from kernels.backend import native_cpu_backend
from kernels.linear import AMX_SMALL_BATCH_MAX_ROWS, SMALL_BATCH_MAX_ROWS, onednn_packer, small_batch_kernels

pytestmark = pytest.mark.usefixtures("poisoned_allocations")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("out_features, in_features", [(64, 512), (67, 100), (5, 24), (1408, 512)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_small_batch_linear_matches_float64(native_target, rows, out_features, in_features, bias, dtype):
    """Whole blocks of four output rows and the rows left over, whole vectors and a scalar tail of `in`, odd and even
    counts of activation rows (they go four, two and one at a time), both dtypes (bfloat16: vdpbf16ps where the CPU has
    AVX512-BF16, else widened to float32); the float64 product of the same (rounded) inputs, then the output's
    rounding."""
    generator = torch.Generator().manual_seed(rows * out_features + in_features)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    b = torch.randn(out_features, generator=generator).to(dtype) if bias else None

    got = cpu_native.load(native_target).small_batch_linear(x, weight, b)

    want = F.linear(x.double(), weight.double(), b.double() if bias else None)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4 * in_features ** 0.5)
    else:  # float32 sums, then one rounding to bfloat16 (8 bits): half a unit in the last place, plus the sums' error
        torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-4 * in_features ** 0.5)


def test_strided_activations_and_bad_shapes(native_target):
    kernel = cpu_native.load(native_target).small_batch_linear
    weight = torch.randn(16, 32)
    x = torch.randn(3, 64)[:, ::2]  # not contiguous
    torch.testing.assert_close(kernel(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="columns"):
        kernel(torch.randn(2, 31), weight)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        kernel(torch.randn(2, 32).bfloat16(), weight)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        kernel(torch.randn(2, 32).half(), weight.half())


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 40, 128])
@pytest.mark.parametrize("out_features, in_features", [(64, 512), (67, 100), (5, 24), (1408, 576), (130, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_small_batch_linear_matches_float64(native_target, rows, out_features, in_features, bias):
    """Whole and partial tiles of 16 outputs, passes of four tiles (one block of rows) or two (more) and the tiles left
    over, `in` in whole steps of 32 (whole blocks of 16 rows read from x) and partial ones (every block copied and
    padded), 1-128 rows: one block, a short one, pairs of blocks and a block left over, the last block short or whole;
    builds without AMX code say so."""
    native = cpu_native.load(native_target)
    generator = torch.Generator().manual_seed(rows * out_features + in_features)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    b = torch.randn(out_features, generator=generator).bfloat16() if bias else None
    if not native.amx_linear_available():
        assert not amx_tiles_expected(native_target)
        with pytest.raises(RuntimeError, match="AMX"):
            native.amx_small_batch_linear(x, native.amx_weight_tiles(weight), out_features, b)
        return

    tiles = native.amx_weight_tiles(weight)
    got = native.amx_small_batch_linear(x, tiles, out_features, b)

    want = F.linear(x.double(), weight.double(), b.double() if bias else None)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert tiles.shape == (-(-out_features // 16), -(-in_features // 32), 16, 32)
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-4 * in_features ** 0.5)


def test_amx_small_batch_linear_refuses_what_it_cannot_take(native_target):
    native = cpu_native.load(native_target)
    if not native.amx_linear_available():
        with pytest.raises(RuntimeError, match="AMX"):
            native.amx_weight_tiles(torch.randn(16, 32).bfloat16())
        return
    weight = torch.randn(40, 48).bfloat16()
    tiles = native.amx_weight_tiles(weight)
    with pytest.raises(RuntimeError, match="m <= 128"):
        native.amx_small_batch_linear(torch.randn(129, 48).bfloat16(), tiles, 40)
    with pytest.raises(RuntimeError, match="another shape"):
        native.amx_small_batch_linear(torch.randn(2, 80).bfloat16(), tiles, 40)
    with pytest.raises(RuntimeError, match="another shape"):
        native.amx_small_batch_linear(torch.randn(2, 48).bfloat16(), tiles, 60)
    with pytest.raises(RuntimeError, match="bfloat16"):
        native.amx_small_batch_linear(torch.randn(2, 48), tiles, 40)
    with pytest.raises(RuntimeError, match="bfloat16"):
        native.amx_weight_tiles(weight.float())


@pytest.mark.parametrize("name", NATIVE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_packed_weight_given_the_kernel_multiplies_small_batches_on_its_second_copy(name, dtype):
    """The build's kernel for the dtype: the vector product on the weight as it is, or (bfloat16 where the CPU has
    AMX) the tile product on the weight's tiles; larger batches go to oneDNN's packed product."""
    native = cpu_native.load(TARGETS[name])
    weight = torch.randn(40, 48).to(dtype)
    kernel = small_batch_kernels(native)[dtype]
    calls = []

    def counted(x, copy, bias, out):
        calls.append(x.shape[0])
        return kernel.product(x, copy, bias, out)

    kernels = {dtype: dataclasses.replace(kernel, product=counted)}
    packed = onednn_packer(kernels)(weight, keep_dense=True)
    if packed is None:  # this oneDNN cannot pack bfloat16 (AVX2 alone): F.linear multiplies it as it is
        assert dtype == torch.bfloat16
        return
    amx = dtype == torch.bfloat16 and native.amx_linear_available()
    assert kernel.max_rows == (AMX_SMALL_BATCH_MAX_ROWS if amx else SMALL_BATCH_MAX_ROWS[dtype])
    limit = kernel.max_rows
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 1e-2}
    for rows in (1, limit, limit + 1, limit + 64):
        x = torch.randn(rows, 48).to(dtype)
        torch.testing.assert_close(packed.matmul(x, None), F.linear(x, weight), **tolerance)
    assert calls == [1, limit]  # larger batches: oneDNN's packed product
    # both copies are held (the tiles: whole tiles of 16 outputs by 32 inputs, zero-padded)
    second = 48 * 64 * 2 if amx else weight.numel() * weight.element_size()
    assert packed.dense_copy_bytes == second and packed.nbytes == weight.numel() * weight.element_size()
    assert onednn_packer(kernels)(weight).dense_copy_bytes == 0  # keep_dense not given: oneDNN's copy alone
    # a weight that stays anyway (the LM head) keeps the kernel where it reads that weight itself, not a new copy
    head = onednn_packer(kernels)(weight, weight_stays=True)
    assert (head.small_batch is not None) == kernel.shares_weight
    if kernel.shares_weight:
        assert head.dense.data_ptr() == weight.data_ptr()


def test_the_backend_gives_the_kernels_to_its_packer_in_every_build_with_vector_code(native_target):
    """Measured faster than oneDNN's at a few rows on the AVX2 EPYC (float32) and on the Intel Xeon with AMX (float32
    and bfloat16); a build without vector code keeps oneDNN's."""
    packed = native_cpu_backend(native_target).pack_linear_weight(torch.randn(40, 48), keep_dense=True)
    assert (packed.small_batch is not None) == (cpu_native.load(native_target).vector_isa() != "scalar")
