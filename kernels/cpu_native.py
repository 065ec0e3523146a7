"""shardserve's native CPU kernels (kernels/cpu/*.cpp), built on first use with torch's C++ extension
loader and cached by it (under $TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions).

On CPU, attention's gathers and per-op overhead, not matrix products, decide a decode step's time
(docs/BENCHMARKS.md, "Kernels"): the native decode attention reads each cached K/V row once; the
native prefill attention is a flash-attention loop vectorised over query rows.
The build needs a C++ compiler and ninja (the `ninja` package is a dependency) and takes about
30 s once per machine. Where it can't be built, or with SHARDSERVE_CPU_KERNELS=0, `load()` returns
None and the torch references run instead; that is logged once.

The build targets the machine it runs on (-march=native: AVX-512 where the CPU has it, else AVX2 with
FMA, else plain C++): the cache must not be shared between machines of different CPU families.
SHARDSERVE_CPU_ISA=avx2 builds for AVX2 with FMA and no AVX-512 instead (-march=haswell: what AMD Zen 2
and 3 run), under its own name beside the native build: it runs those code paths on an AVX-512 machine,
where the tests run both builds (`runnable_isas`). Each checkout builds under its own name
(the extension's name carries a hash of the sources' folder): torch keeps one build per name and rebuilds
it whenever the compile command changes, so two checkouts on one machine sharing a name rebuilt it
(~30 s, ~50 s with the cores busy) every time the other had loaded it, in every new replica process.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

from kernels import switched_on

logger = logging.getLogger("shardserve.kernels")

SOURCES = [
    Path(__file__).parent / "cpu" / name
    for name in ("bindings.cpp", "paged_attention.cpp", "elementwise.cpp", "sampling.cpp", "bitmask.cpp", "linear.cpp", "threads.cpp")
]
# one build per checkout: its folder's path, hashed, in the name
EXTENSION_NAME = "shardserve_cpu_kernels_" + hashlib.sha256(str(SOURCES[0].parent.resolve()).encode()).hexdigest()[:12]
CFLAGS = ["-O3", "-fopenmp", "-ffast-math"]
# SHARDSERVE_CPU_ISA -> the target's flags (-march=haswell: AVX2, FMA, F16C, BMI2; no AVX-512)
ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-march=haswell"]}


def enabled() -> bool:
    return switched_on("SHARDSERVE_CPU_KERNELS")


def isa() -> str:
    """The build target SHARDSERVE_CPU_ISA names: "native" (the default) or "avx2"."""
    name = os.environ.get("SHARDSERVE_CPU_ISA", "native").lower() or "native"
    if name not in ISA_FLAGS:
        raise ValueError(f"SHARDSERVE_CPU_ISA={name!r}: choose one of {', '.join(ISA_FLAGS)}")
    return name


def extension_name(target: str) -> str:
    """The native build keeps the plain name; another target's name ends with it."""
    return EXTENSION_NAME if target == "native" else f"{EXTENSION_NAME}_{target}"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo's first "flags" line, read once; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def runnable_isas() -> list[str]:
    """The builds worth running here: native, and avx2 too where native is AVX-512 and the CPU also has
    AVX2 and FMA (the two builds then run different vector code)."""
    flags = cpu_flags()
    return ["native", "avx2"] if {"avx512f", "avx2", "fma"} <= flags else ["native"]


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary is in the venv, which need not be on it."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = str(ninja.BIN_DIR)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def load(target: str | None = None) -> ModuleType | None:
    """The extension compiled for `target` (default: SHARDSERVE_CPU_ISA's), or None when disabled or it
    can't be built here."""
    if not enabled():
        logger.info("native CPU kernels disabled (SHARDSERVE_CPU_KERNELS=0): using the torch references")
        return None
    return _load(target or isa())


@functools.cache
def _load(target: str) -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load as load_extension

        _put_ninja_on_path()
        return load_extension(
            name=extension_name(target),
            sources=[str(s) for s in SOURCES],
            extra_cflags=CFLAGS + ISA_FLAGS[target],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a build error: fall back, loudly once
        logger.warning("native CPU kernels (%s) unavailable (%s); using the torch references", target, exc)
        return None


def prefill_supported(head_dim: int, block_size: int, target: str | None = None) -> bool:
    """The native prefill kernel needs AVX-512 or AVX2, head_dim a multiple of 16 (<= 256) and 16-token blocks."""
    return load(target).prefill_supported(head_dim, block_size)


if __name__ == "__main__":  # `python -m kernels.cpu_native`: build now (make install does), say how it went
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = load()
    built = f"built, {module.__file__} ({module.vector_isa()} code)" if module else None
    print(f"native CPU kernels: {built or 'unavailable (torch references will run)'}")
