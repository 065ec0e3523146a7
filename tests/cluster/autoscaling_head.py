"""A Ray head on 127.0.0.1 whose autoscaler adds and removes worker nodes on this machine (Ray's fake multi-node
provider, `ray.autoscaler._private.fake_multi_node`): the node autoscaling that KubeRay does for a GPU fleet.

`ray.cluster_utils.AutoscalingCluster` would do this, but it runs `ray stop --force`, which ends every Ray on the
machine. So the head is `ray start --head --block` in a temp dir of its own, and stopping it ends only its own
processes: the `ray start` process and its descendants (GCS, raylet, the autoscaler's monitor, which starts each
worker node's raylet as its own child), and any process with a file open under the temp dir (every Ray process
logs there, worker nodes' ones too, since they use the head's temp dir), however it was re-parented.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from app.ray_cluster import descendants
from tests.app.conftest import free_port

HEAD_NODE_TYPE = "ray.head.default"  # the fake provider's name for the head
# SIGTERM, then SIGKILL after this: `ray start --block`, GCS and raylets stay past SIGTERM while their peers go
STOP_GRACE_S = 2.0
START_BOUND_S = 120.0


@dataclass
class AutoscalingHead:
    address: str
    temp_dir: Path
    process: subprocess.Popen
    log: Path


def autoscaler_config(address: str, head_resources: dict[str, float], worker_types: dict[str, dict],
                      idle_timeout_s: float) -> dict:
    """The cluster config the head's autoscaler reads (the keys of Ray's fake_multi_node/example.yaml)."""
    return {
        "cluster_name": "shardserve-test",
        "max_workers": sum(t["max_workers"] for t in worker_types.values()),
        # gcs_address: the provider's worker nodes join this head (its default is port 6379, anyone's cluster)
        "provider": {"type": "fake_multinode", "gcs_address": address, "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True},
        "available_node_types": {HEAD_NODE_TYPE: {"resources": head_resources, "node_config": {}, "max_workers": 0},
                                 **{name: {"node_config": {}, **t} for name, t in worker_types.items()}},
        "head_node_type": HEAD_NODE_TYPE,
        "idle_timeout_minutes": idle_timeout_s / 60,
        "upscaling_speed": 1.0,
        "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def ray_env() -> dict[str, str]:
    """Environment of the head and of every process that joins it."""
    return {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # every port on 127.0.0.1
        # explicit: `ray start` turns token auth on when some earlier Ray left ~/.ray/auth_token behind, and a
        # process that once started a local Ray carries RAY_AUTH_MODE=token; without it set, clients and head differ
        "RAY_AUTH_MODE": "disabled",
    }


@contextmanager
def autoscaling_head(head_resources: dict[str, float], worker_types: dict[str, dict],
                     idle_timeout_s: float) -> Iterator[AutoscalingHead]:
    """Start the head (no worker nodes: each type's min_workers may add some); on leaving, end all its processes
    and check that none is left."""
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-"))  # short: Ray's socket paths live under it
    port = free_port()
    address = f"127.0.0.1:{port}"
    config = temp_dir / "autoscaler.json"
    config.write_text(json.dumps(autoscaler_config(address, head_resources, worker_types, idle_timeout_s)))
    resources = {k: v for k, v in head_resources.items() if k not in ("CPU", "object_store_memory")}
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
               "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}", f"--autoscaling-config={config}",
               f"--num-cpus={head_resources['CPU']}", f"--resources={json.dumps(resources)}",
               f"--object-store-memory={int(head_resources['object_store_memory'])}",
               "--include-dashboard=false", "--disable-usage-stats",
               # every port Ray would otherwise take at a fixed number (other clusters may hold them)
               f"--ray-client-server-port={free_port()}", f"--dashboard-port={free_port()}",
               f"--dashboard-agent-listen-port={free_port()}", "--min-worker-port=0", "--max-worker-port=0"]
    env = {**os.environ, **ray_env(), "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    log = temp_dir / "head.log"
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    head = AutoscalingHead(address, temp_dir, process, log)
    try:
        _wait_until_started(head)
        yield head
    finally:
        left = stop(head)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"processes of the autoscaling head outlived its stop: {left}"


def _wait_until_started(head: AutoscalingHead) -> None:
    """`ray start --block` prints this line once the head's processes run (then it blocks)."""
    deadline = time.monotonic() + START_BOUND_S
    while "This command will now block" not in head.log.read_text():
        assert head.process.poll() is None, head.log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the head did not start:\n" + head.log.read_text()[-3000:]
        time.sleep(0.2)


def head_processes(head: AutoscalingHead) -> list[int]:
    """Every live process of this head: `ray start` and its descendants, and whatever has a file open under
    its temp dir."""
    found = [head.process.pid, *descendants(head.process.pid)]
    prefix = str(head.temp_dir) + os.sep
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in found:
            continue
        try:
            if any(os.readlink(fd).startswith(prefix) for fd in (proc / "fd").iterdir()):
                found.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return [pid for pid in found if _running(pid)]


def stop(head: AutoscalingHead) -> list[str]:
    """SIGTERM every process of the head, SIGKILL what is left after STOP_GRACE_S, until a scan finds none (a
    raylet may start a worker meanwhile); returns the command lines of those still running at the end."""
    deadline = time.monotonic() + 5 * STOP_GRACE_S
    sig = signal.SIGTERM
    while (pids := head_processes(head)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        grace = time.monotonic() + STOP_GRACE_S
        while any(map(_running, pids)) and time.monotonic() < grace:
            head.process.poll()  # reap `ray start`, our child
            time.sleep(0.1)
        sig = signal.SIGKILL
    head.process.poll()
    return [_cmdline(pid) for pid in head_processes(head)]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        return f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
    except OSError:
        return f"{pid}: (gone)"
