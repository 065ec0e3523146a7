"""The native small-batch linear product (kernels/cpu/linear.cpp): x W^T (+ b) for a few float32 or bfloat16 rows, on
the weight as it is, against float64; and which products a build's packer hands it."""

import pytest
import torch
import torch.nn.functional as F
from native_builds import NATIVE_BACKENDS, TARGETS

from kernels import cpu_native
from kernels.backend import native_cpu_backend
from kernels.linear import SMALL_BATCH_MAX_ROWS, onednn_packer

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


@pytest.mark.parametrize("name", NATIVE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_packed_weight_given_the_kernel_multiplies_small_batches_on_its_dense_copy(name, dtype):
    native = cpu_native.load(TARGETS[name])
    weight = torch.randn(40, 48).to(dtype)
    calls = []

    def counted(x, w, bias=None):
        calls.append(x.shape[0])
        return native.small_batch_linear(x, w, bias)

    packed = onednn_packer(counted)(weight, keep_dense=True)
    if packed is None:  # this oneDNN cannot pack bfloat16 (AVX2 alone): F.linear multiplies it as it is
        assert dtype == torch.bfloat16
        return
    limit = SMALL_BATCH_MAX_ROWS[dtype]
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 1e-2}
    for rows in (1, limit, limit + 1, 64):
        x = torch.randn(rows, 48).to(dtype)
        torch.testing.assert_close(packed.matmul(x, None), F.linear(x, weight), **tolerance)
    assert calls == [1, limit]  # larger batches: oneDNN's packed product
    assert packed.dense_copy_bytes == packed.nbytes == weight.numel() * weight.element_size()  # both copies held
    assert onednn_packer(counted)(weight).dense_copy_bytes == 0  # keep_dense not given: oneDNN's copy alone


def test_the_backend_gives_the_kernel_to_its_packer_in_every_build_with_vector_code(native_target):
    """Measured faster than oneDNN's at a few rows on the AVX2 EPYC (float32) and on the Intel Xeon with AMX (float32
    and bfloat16); a build without vector code keeps oneDNN's."""
    packed = native_cpu_backend(native_target).pack_linear_weight(torch.randn(40, 48), keep_dense=True)
    assert (packed.small_batch is not None) == (cpu_native.load(native_target).vector_isa() != "scalar")
