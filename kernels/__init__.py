import os


def switched_on(name: str) -> bool:
    """A switch in the environment that is on unless set to 0, false, off or no (SHARDSERVE_CPU_KERNELS,
    SHARDSERVE_MALLOC_TUNING, SHARDSERVE_LINEAR_ROW_BUCKETS)."""
    return os.environ.get(name, "1").lower() not in ("0", "false", "off", "no")
