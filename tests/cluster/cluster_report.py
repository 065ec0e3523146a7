"""Where things run on a Ray cluster, as JSON on stdout: `python -m tests.cluster.cluster_report ADDRESS`.

A process of its own, so that the test process (which may hold the session's local Ray) never connects to the
multi-node cluster: Serve's replicas with their node, the proxies' nodes, each placement group's bundles, and
the nodes alive.
"""

from __future__ import annotations

import json
import logging
import os
import sys


def report(address: str) -> dict:
    """Serve's view (replicas, proxies), the placement groups and the live nodes of the cluster at `address`."""
    import ray
    from ray import serve

    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    try:
        details = serve.context._get_global_client().get_serve_details()
        groups = ray.util.placement_group_table()
        nodes = ray.nodes()
    finally:
        ray.shutdown()
    return {
        "replicas": {name: [{"replica_id": r["replica_id"], "node_id": r.get("node_id"), "state": r["state"]}
                            for r in deployment["replicas"]]
                     for app in details.get("applications", {}).values()
                     for name, deployment in app["deployments"].items()},
        "proxies": sorted(details.get("proxies") or {}),
        "placement_groups": [{"name": g["name"], "state": g["state"], "strategy": g["strategy"],
                              "nodes": sorted(set(g["bundles_to_node_id"].values())),
                              "bundles": list(g["bundles"].values())}
                             for g in groups.values() if g["state"] != "REMOVED"],
        "nodes": sorted(n["NodeID"] for n in nodes if n["Alive"]),
    }


if __name__ == "__main__":
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    print(json.dumps(report(sys.argv[1])))
