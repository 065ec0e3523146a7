"""Where `shardserve serve` puts the CPU work of its own local cluster: the engine's threads on their cores, and
Ray's and Serve's processes on the cores no rank computes on (issue 29, docs/OPERATIONS.md "CPU threads").

`cpu_threads_bind` (engine/cpu_binding.py) binds each rank's torch threads to cores. On a cluster this CLI starts
itself it resolves "auto" here, for this machine, and where the result leaves cores out of every rank's list (a
node of more than 2 cores keeps one), the CLI moves its own threads onto those cores before Ray starts: every
process Ray starts inherits them (the GCS, the raylet, Serve's controller, the replica and TP worker processes),
and only the ranks' bound threads leave them, so Ray's wake-ups never preempt a compute thread. Replicas that may
share a node (more than one) stay unbound under "auto": their lists would overlap. On a cluster it joins, "auto"
binds nothing (a pod may see more cores than its CPU quota gives it), and Ray's processes there are placed by
whoever started them: give lists where a node's cores are the replica's alone.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from app.config import ServeArgs
from app.replica_device import deployment_wants_gpus
from engine.cpu_binding import allowed_cores, format_core_list, left_out_cores, resolve_auto

logger = logging.getLogger("shardserve.cli")


def plan_cpu_threads_bind(args: ServeArgs, own_cluster: bool) -> ServeArgs:
    """`args` with "auto" resolved as far as the CLI can: "none" where several replicas may share a node or the
    replicas compute on GPUs, this machine's lists on a cluster of our own, else "auto" for the replica."""
    if args.cpu_threads_bind != "auto":
        return args
    if (args.num_replicas or args.max_replicas) > 1 or args.cpu_threads is not None:
        return args.model_copy(update={"cpu_threads_bind": "none"})
    if not own_cluster:
        return args
    if deployment_wants_gpus(args):  # (torch is imported for this: last)
        return args.model_copy(update={"cpu_threads_bind": "none"})
    return args.model_copy(update={"cpu_threads_bind": resolve_auto(args.tensor_parallel_size, allowed_cores())})


def keep_control_plane_off_compute_cores(args: ServeArgs) -> list[int]:
    """Before our own Ray starts: move this process's threads onto the cores no rank's list has, so that
    everything Ray starts runs there; returns those cores (none: nothing moved)."""
    cores = left_out_cores(args.cpu_threads_bind, allowed_cores())
    if not cores or deployment_wants_gpus(args):
        return []
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            continue
    logger.info("Ray and Serve run on core(s) %s; the engine's threads on %s", format_core_list(cores),
                args.cpu_threads_bind)
    return cores
