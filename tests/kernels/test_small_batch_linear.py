"""The native small-batch linear product (kernels/cpu/linear.cpp): x W^T (+ b) for a few float32 rows, on the
weight as it is, against float64; and where the AVX2 build's packer hands it the products it takes."""

import pytest
import torch
import torch.nn.functional as F
from native_builds import NATIVE_BACKENDS, TARGETS

from kernels import cpu_native
from kernels.backend import native_cpu_backend
from kernels.linear import SMALL_BATCH_MAX_ROWS, onednn_packer

pytestmark = pytest.mark.usefixtures("poisoned_allocations")


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("out_features, in_features", [(64, 512), (67, 100), (5, 24), (1408, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_small_batch_linear_matches_float64(native_target, rows, out_features, in_features, bias):
    """Whole blocks of four output rows and the rows left over, whole vectors and a scalar tail of `in`, an odd
    and an even count of activation rows (they go two at a time)."""
    generator = torch.Generator().manual_seed(rows * out_features + in_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None

    got = cpu_native.load(native_target).small_batch_linear(x, weight, b)

    want = F.linear(x.double(), weight.double(), b.double() if bias else None)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4 * in_features ** 0.5)


def test_strided_activations_and_bad_shapes(native_target):
    kernel = cpu_native.load(native_target).small_batch_linear
    weight = torch.randn(16, 32)
    x = torch.randn(3, 64)[:, ::2]  # not contiguous
    torch.testing.assert_close(kernel(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="columns"):
        kernel(torch.randn(2, 31), weight)
    with pytest.raises(RuntimeError, match="float32"):
        kernel(torch.randn(2, 32).bfloat16(), weight.bfloat16())


@pytest.mark.parametrize("name", NATIVE_BACKENDS)
def test_a_packed_weight_given_the_kernel_multiplies_small_batches_on_its_dense_copy(name):
    native = cpu_native.load(TARGETS[name])
    weight = torch.randn(40, 48)
    calls = []

    def counted(x, w, bias=None):
        calls.append(x.shape[0])
        return native.small_batch_linear(x, w, bias)

    packed = onednn_packer(counted)(weight, keep_dense=True)
    for rows in (1, SMALL_BATCH_MAX_ROWS, SMALL_BATCH_MAX_ROWS + 1, 64):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(packed.matmul(x, None), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert calls == [1, SMALL_BATCH_MAX_ROWS]  # larger batches: oneDNN's packed product
    assert packed.dense_copy_bytes == packed.nbytes == weight.numel() * 4  # both copies are held
    assert onednn_packer(counted)(weight).dense_copy_bytes == 0  # keep_dense not given: oneDNN's copy alone
    bf16 = onednn_packer(counted)(weight.bfloat16(), keep_dense=True)
    assert bf16 is None or bf16.small_batch is None  # float32 only (None: this oneDNN cannot pack bfloat16)


def test_the_backend_gives_the_kernel_to_its_packer_in_the_avx2_build_only(native_target):
    """Where it was measured faster than oneDNN's (the AVX2 EPYC); the AVX-512 build keeps oneDNN's."""
    packed = native_cpu_backend(native_target).pack_linear_weight(torch.randn(40, 48), keep_dense=True)
    assert (packed.small_batch is not None) == (cpu_native.load(native_target).vector_isa() == "avx2")
