"""Binding the calling thread's OpenMP team to cores (the native kernels' bind_omp_threads)."""

from __future__ import annotations

import logging

from kernels import cpu_native

logger = logging.getLogger("shardserve.kernels")


def bind_threads(cores: list[int]) -> list[int] | None:
    """torch's threads for the calling thread, one bound to each of `cores` (the caller to the first); returns
    the core each runs on, or None where the native kernels are unavailable (the threads stay unbound)."""
    module = cpu_native.load()
    if module is None:
        logger.warning("cpu_threads_bind %s: the native CPU kernels are unavailable, threads left unbound", cores)
        return None
    return list(module.bind_omp_threads(list(cores)))
