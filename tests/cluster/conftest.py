"""A multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: one raylet per node, all on
127.0.0.1), started once per module and stopped by it: a head without the accelerator resource and two worker
nodes that have it, as ops/terraform sets up a GPU fleet (a custom resource stands in for the GPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


@pytest.fixture(scope="module")
def ray_nodes():
    """The head and two accelerator nodes, no driver connected from this process; shut down after the module."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": HEAD_CPUS, "include_dashboard": False})
    try:
        workers = [cluster.add_node(num_cpus=WORKER_CPUS, resources={ACCELERATOR: ACCELERATORS_PER_NODE})
                   for _ in range(2)]
        yield RayNodes(cluster, cluster.address, cluster.head_node.node_id, [w.node_id for w in workers])
    finally:
        cluster.shutdown()
