"""The native CPU kernels' builds the tests run (kernels/cpu_native.py): "cpu", the native build, and where
this CPU has AVX-512 and AVX2 both, "cpu-avx2", the AVX2 build (the vector code AMD Zen 2 and 3 run)."""

from __future__ import annotations

import os
import re

from kernels import cpu_native
from kernels.backend import KernelBackend, native_cpu_backend

# backend fixture names -> cpu_native build targets
TARGETS = {("cpu" if target == "native" else f"cpu-{target}"): target for target in cpu_native.runnable_isas()}
NATIVE_BACKENDS = list(TARGETS)


def native_backend(name: str) -> KernelBackend:
    """The `cpu` backend of one of NATIVE_BACKENDS' builds."""
    return native_cpu_backend(TARGETS[name])


def amx_tiles_expected(target: str) -> bool:
    """Whether `target`'s build should run AMX tile code here: the CPU has AMX, the build is the native one
    (-march=native; the AVX2 build has no AMX code), and Linux is 5.16 or later, which lets a process ask for the
    tile state (arch_prctl ARCH_REQ_XCOMP_PERM; an older kernel refuses and the build falls back)."""
    release = re.match(r"(\d+)\.(\d+)", os.uname().release)
    recent = release is not None and (int(release[1]), int(release[2])) >= (5, 16)
    return "amx_bf16" in cpu_native.cpu_flags() and target == "native" and recent
