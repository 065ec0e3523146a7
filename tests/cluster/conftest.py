"""A multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: one raylet per node, all on
127.0.0.1), started once per module and stopped by it: a head without the accelerator resource and two worker
nodes that have it, as ops/terraform sets up a GPU fleet (a custom resource stands in for the GPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

ACCELERATOR = "accel"
# one TP=2 replica per worker node: 2 accelerators, and exactly the CPUs of its two bundles (0.5 each), so
# what asks for CPUs only (the ingress) has room on the head alone
ACCELERATORS_PER_NODE = 2
CPUS_PER_RANK = 0.5
WORKER_CPUS = 1
HEAD_CPUS = 2


@dataclass
class RayNodes:
    cluster: object  # ray.cluster_utils.Cluster
    address: str
    head: str  # node ids
    workers: list[str]

    def report(self) -> dict:
        """Where the cluster's Serve replicas, proxies and placement groups are (tests/cluster/cluster_report.py)."""
        out = subprocess.run([sys.executable, "-m", "tests.cluster.cluster_report", self.address],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def report_when_running(self, deployment: str, count: int, timeout_s: float = 120) -> dict:
        """The first report with `count` RUNNING replicas of `deployment`: /health answers once one replica
        is up, and on busy cores the others may still be starting (a bounded poll of Serve's state)."""
        deadline = time.monotonic() + timeout_s
        while True:
            where = self.report()
            states = [r["state"] for r in where["replicas"].get(deployment, [])]
            if states.count("RUNNING") >= count or time.monotonic() > deadline:
                return where
            time.sleep(1)  # between polls (each report is a Ray driver of its own)


@pytest.fixture(scope="module")
def ray_nodes():
    """The head and two accelerator nodes, no driver connected from this process; shut down after the module."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": HEAD_CPUS, "include_dashboard": False})
    _forget_cluster_address(cluster.address)
    try:
        workers = [cluster.add_node(num_cpus=WORKER_CPUS, resources={ACCELERATOR: ACCELERATORS_PER_NODE})
                   for _ in range(2)]
        yield RayNodes(cluster, cluster.address, cluster.head_node.node_id, [w.node_id for w in workers])
    finally:
        cluster.shutdown()


def _forget_cluster_address(address: str) -> None:
    """Cluster writes its address where a bare `ray.init()` looks for one to join (Ray's temp dir,
    ray_current_cluster): take it back, so that a test running beside this module (make test runs two files at
    once) starts a Ray of its own instead of joining this cluster. Tests reach it by its address only."""
    from ray._common.utils import reset_ray_address
    from ray._private.utils import read_ray_address

    if read_ray_address() == address:
        reset_ray_address()
