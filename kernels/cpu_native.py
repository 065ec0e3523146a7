"""shardserve's native CPU kernels (kernels/cpu/*.cpp), built on first use with torch's C++ extension
loader and cached by it (under $TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions).

On CPU, attention's gathers and per-op overhead, not matrix products, decide a decode step's time
(docs/BENCHMARKS.md, "Kernels"): the native decode attention reads each cached K/V row once; the
native prefill attention is a flash-attention loop vectorised over query rows.
The build needs a C++ compiler and ninja (the `ninja` package is a dependency) and takes about
30 s once per machine. Where it can't be built, or with SHARDSERVE_CPU_KERNELS=0, `load()` returns
None and the torch references run instead; that is logged once.

The build targets the machine it runs on (-march=native, AVX-512 where the CPU has it): the cache
must not be shared between machines of different CPU families. Each checkout builds under its own name
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

logger = logging.getLogger("shardserve.kernels")

SOURCES = [
    Path(__file__).parent / "cpu" / name
    for name in ("bindings.cpp", "paged_attention.cpp", "elementwise.cpp", "sampling.cpp", "bitmask.cpp")
]
# one build per checkout: its folder's path, hashed, in the name
EXTENSION_NAME = "shardserve_cpu_kernels_" + hashlib.sha256(str(SOURCES[0].parent.resolve()).encode()).hexdigest()[:12]
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]


def enabled() -> bool:
    return os.environ.get("SHARDSERVE_CPU_KERNELS", "1").lower() not in ("0", "false", "off", "no")


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary is in the venv, which need not be on it."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = str(ninja.BIN_DIR)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def load() -> ModuleType | None:
    """The compiled extension, or None when disabled or it can't be built here."""
    if not enabled():
        logger.info("native CPU kernels disabled (SHARDSERVE_CPU_KERNELS=0): using the torch references")
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        _put_ninja_on_path()
        return load_extension(
            name=EXTENSION_NAME, sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS, verbose=False
        )
    except Exception as exc:  # no compiler, no ninja, a build error: fall back, loudly once
        logger.warning("native CPU kernels unavailable (%s); using the torch references", exc)
        return None


def prefill_supported(head_dim: int, block_size: int) -> bool:
    """The native prefill kernel needs AVX-512, head_dim a multiple of 16 (<= 256) and 16-token blocks."""
    return load().prefill_supported(head_dim, block_size)


if __name__ == "__main__":  # `python -m kernels.cpu_native`: build now (make install does), say how it went
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    module = load()
    print(
        f"native CPU kernels: {'built, ' + module.__file__ if module else 'unavailable (torch references will run)'}"
    )
