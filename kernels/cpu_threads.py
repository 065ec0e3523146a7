"""Binding the calling thread's OpenMP team to cores (the native kernels' bind_omp_threads)."""

from __future__ import annotations

import logging
import os

from kernels import cpu_native

logger = logging.getLogger("shardserve.kernels")


def bind_threads(cores: list[int]) -> list[int] | None:
    """torch's threads for the calling thread, one bound to each of `cores` (the caller to the first); returns
    the core each runs on. Where the native kernels are unavailable the calling thread only is kept to `cores`
    (a team it starts from then on inherits them, but not one core a thread), and None is returned."""
    module = cpu_native.load()
    if module is None:
        logger.warning("cpu_threads_bind %s: without the native CPU kernels the threads share those cores, one "
                       "core each only with them", cores)
        os.sched_setaffinity(0, cores)
        return None
    return list(module.bind_omp_threads(list(cores)))
