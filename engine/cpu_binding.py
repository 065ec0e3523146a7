"""Which cores a rank's CPU threads run on: EngineConfig.cpu_threads_bind, vLLM's VLLM_CPU_OMP_THREADS_BIND.

"none" leaves the threads to the OS. A list of cores ("0-3", "0,2,4-5"), one per tensor-parallel rank separated
by "|" ("0-1|2-3"), binds one torch thread of the rank to each core of its list, the thread that runs the steps
to the first. "auto" is resolved by `shardserve serve` for the machine it starts its own Ray on
(`resolve_auto`, app/cpu_placement.py): on a node of more than SMALL_NODE_CORES cores it keeps RESERVED_CORES
out of the ranks' lists, for the control plane (Ray's and Serve's processes, the HTTP server, the grammar
compiler), and binds the rest, split evenly between the ranks; on a node of at most SMALL_NODE_CORES it stays
unbound, since binding both cores of a 2-core machine measured no faster served (docs/BENCHMARKS.md, "CPU
threads and Ray's worker niceness"). Everywhere else "auto" is unbound: the offline `LLM` steps on its caller's
thread (whose affinity every thread and process it starts later would inherit), and on a cluster shardserve did
not start, a node may hold several replicas, or a container may see cores its CPU quota does not give it.

A bound thread's own affinity is one core from then on, and threads it starts inherit it: the engine's helper
threads (the swap copier, the grammar compiler, the grammar-mask filler) call `unbind_current_thread` first,
which gives them back the cores the process had (`allowed_cores`, read before any binding).
"""

from __future__ import annotations

import functools
import os
import re

# nodes of at most this many cores stay unbound under "auto"
SMALL_NODE_CORES = 2
# cores "auto" leaves to the control plane on a larger node
RESERVED_CORES = 1

_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


@functools.cache
def allowed_cores() -> frozenset[int]:
    """The cores this process may run on (its CPU affinity, as a container's cpuset limits it), read once:
    binding narrows the bound thread's own affinity afterwards."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def unbind_current_thread() -> None:
    """Let the calling thread run on every core the process had (a helper thread started by a bound one)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, allowed_cores())


def parse_core_list(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]; a range must not run backwards and no core may repeat."""
    text = text.strip()
    if not _LIST.match(text):
        raise ValueError(f"{text!r} is not a list of cores like '0-3' or '0,2,4-5'")
    cores: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"the range {part!r} runs backwards")
        cores.extend(range(low, high + 1))
    if len(set(cores)) != len(cores):
        raise ValueError(f"{text!r} names a core twice")
    return cores


def format_core_list(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts: list[list[int]] = []
    for core in cores:
        if parts and core == parts[-1][-1] + 1:
            parts[-1].append(core)
        else:
            parts.append([core])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in parts)


def rank_lists(setting: str) -> list[list[int]] | None:
    """Each rank's cores of a list setting (None for "auto" and "none")."""
    if setting in ("auto", "none"):
        return None
    return [parse_core_list(part) for part in setting.split("|")]


def check_setting(setting: str, tensor_parallel_size: int) -> None:
    """The setting's syntax, and one list per rank with no core given twice (EngineConfig's validator)."""
    try:
        lists = rank_lists(setting)
    except ValueError as e:
        raise ValueError(f"cpu_threads_bind {setting!r}: {e}") from None
    if lists is None:
        return
    if len(lists) != tensor_parallel_size:
        raise ValueError(f"cpu_threads_bind {setting!r} has {len(lists)} list(s) of cores for "
                         f"{tensor_parallel_size} tensor-parallel rank(s): give one per rank, separated by '|'")
    flat = [core for cores in lists for core in cores]
    if len(set(flat)) != len(flat):
        raise ValueError(f"cpu_threads_bind {setting!r} gives one core to two ranks")


def resolve_auto(tensor_parallel_size: int, allowed: frozenset[int] | set[int]) -> str:
    """What "auto" means for a replica alone on a node whose processes may run on `allowed`: one list per rank,
    or "none" on a small node or where there are fewer cores to compute on than ranks."""
    cores = sorted(allowed)
    if len(cores) <= SMALL_NODE_CORES:
        return "none"
    compute = cores[:-RESERVED_CORES]
    share = len(compute) // tensor_parallel_size
    if share == 0:
        return "none"
    return "|".join(format_core_list(compute[rank * share:(rank + 1) * share]) for rank in range(tensor_parallel_size))


def left_out_cores(setting: str, allowed: frozenset[int] | set[int]) -> list[int]:
    """The allowed cores no rank's list has: where the control plane runs (none for "auto" and "none")."""
    lists = rank_lists(setting)
    if lists is None:
        return []
    bound = {core for cores in lists for core in cores}
    return sorted(set(allowed) - bound)
