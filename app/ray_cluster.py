"""The Ray cluster under `shardserve serve`: one it joins (`--ray-address ADDR|auto`), or a local one of its own.

A local cluster's own processes (GCS, raylet, agents) are children of the CLI. Left in its process group, a
signal sent to the whole group (`kill -TERM -- -PGID`, a supervisor's stop) reaches them too: they die first,
and the drain then waits on a cluster that is gone. So they start in a process group of their own, as Ray
already does on Windows (CREATE_NEW_PROCESS_GROUP), and only the CLI hears the group's signal; Ray's workers
(Serve's controller, proxy, replicas) put themselves in groups of their own anyway. Ray still ends them with
the CLI: each is started with PR_SET_PDEATHSIG (Ray's fate sharing), and `end_leftover_processes` ends any
descendant that outlived `ray.shutdown()`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from pathlib import Path

logger = logging.getLogger("shardserve.cli")

PR_SET_CHILD_SUBREAPER = 36
# how long the CLI's descendants get to leave after SIGTERM before they get SIGKILL
LEFTOVER_GRACE_S = 2.0


def ray_processes_in_their_own_process_group() -> None:
    """Make every process Ray starts from this process a process group leader (Ray's own Popen; before ray.init)."""
    from ray._private import services

    if getattr(services.ConsolePopen, "_shardserve_own_group", False):
        return

    class OwnGroupPopen(services.ConsolePopen):
        _shardserve_own_group = True

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("process_group", 0)  # setpgid(0, 0) in the child, before exec
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnGroupPopen


def local_cluster_alive() -> bool:
    """Whether every process of the Ray cluster this process started (GCS, raylet, agents) still runs."""
    import ray

    node = ray._private.worker._global_node  # Ray's own record of the processes it started for us
    return node is None or node.remaining_processes_alive()


def adopt_orphaned_descendants() -> None:
    """Become a child subreaper: a Ray worker whose raylet died is re-parented to this process, not to init, so
    `end_leftover_processes` still finds it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the leftover sweep sees direct children only
        pass


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc's children lists), nearest first."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop(0)
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            for child in children:
                if child not in found:
                    found.append(child)
                    frontier.append(child)
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def end_leftover_processes(grace_s: float = LEFTOVER_GRACE_S) -> list[int]:
    """SIGTERM, then after `grace_s` SIGKILL, every process this one started that still runs; returns them."""
    found = left = [pid for pid in descendants(os.getpid()) if _running(pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while sig == signal.SIGTERM and any(map(_running, left)) and time.monotonic() < deadline:
            _reap_children()
            time.sleep(0.05)
        left = [pid for pid in left if _running(pid)]
        if not left:
            break
    _reap_children()
    return found


def _reap_children() -> None:
    """Collect exited children (adopted orphans included), so they do not linger as zombies."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
