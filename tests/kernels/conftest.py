"""Shared fixtures for the kernel tests: every backend, and poisoned allocations."""

import os

# Triton reads this once, at its first import; the root conftest sets it too.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from native_builds import NATIVE_BACKENDS, TARGETS, native_backend  # noqa: E402

from kernels.backend import KernelBackend, get_backend, native_cpu_backend  # noqa: E402


@pytest.fixture(params=["torch", *NATIVE_BACKENDS, "triton"])
def backend(request) -> KernelBackend:
    """Every shared kernel test runs once per implementation ("cpu": the native C++ kernels, built
    on first use; a machine that can't build them fails here rather than skipping them; "cpu-avx2":
    their AVX2 build too, where this CPU runs both it and AVX-512, native_builds.py)."""
    if request.param in NATIVE_BACKENDS:
        return native_backend(request.param)
    return get_backend(request.param, "cpu")


@pytest.fixture(params=NATIVE_BACKENDS)
def native_target(request) -> str:
    """The tests of the native kernels alone run once per build (native_builds.py): its cpu_native target."""
    return TARGETS[request.param]


@pytest.fixture
def native(native_target) -> KernelBackend:
    """The `cpu` backend of native_target's build."""
    return native_cpu_backend(native_target)


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """Fresh tensors from torch.empty / empty_like start as NaN (floats) or a huge sentinel (ints),
    so an output element a kernel forgets to write fails the comparison instead of reading as zero."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point():
            return tensor.fill_(float("nan"))
        if tensor.dtype != torch.bool:
            return tensor.fill_(torch.iinfo(tensor.dtype).max)
        return tensor

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poison(empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poison(empty_like(*args, **kwargs)))
