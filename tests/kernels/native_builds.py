"""The native CPU kernels' builds the tests run (kernels/cpu_native.py): "cpu", the native build, and where
this CPU has AVX-512 and AVX2 both, "cpu-avx2", the AVX2 build (the vector code AMD Zen 2 and 3 run)."""

from __future__ import annotations

from kernels import cpu_native
from kernels.backend import KernelBackend, native_cpu_backend

# backend fixture names -> cpu_native build targets
TARGETS = {("cpu" if target == "native" else f"cpu-{target}"): target for target in cpu_native.runnable_isas()}
NATIVE_BACKENDS = list(TARGETS)


def native_backend(name: str) -> KernelBackend:
    """The `cpu` backend of one of NATIVE_BACKENDS' builds."""
    return native_cpu_backend(TARGETS[name])
