"""Where things run when `shardserve serve --ray-address` joins a multi-node cluster (tests/cluster/conftest.py):
a TP=2 replica's ranks on one node, two replicas on two nodes when one node cannot hold both, the ingress and
the proxy on the head, which has no accelerator; on SIGTERM the CLI drains, deletes its application and
leaves the cluster running."""

from __future__ import annotations

import signal

import httpx
import pytest

from tests.app.conftest import free_port
from tests.app.test_cli_serve import start_server, stop, wait_until_healthy
from tests.cluster.conftest import ACCELERATOR, CPUS_PER_RANK


@pytest.fixture(scope="module")
def joined_server(ray_nodes, tiny_llama_dir, tmp_path_factory):
    """`shardserve serve --ray-address` with 2 TP=2 replicas that each need a whole accelerator node."""
    port = free_port()
    log = tmp_path_factory.mktemp("joined") / "serve.log"
    server = start_server(tiny_llama_dir, port, log, "--ray-address", ray_nodes.address, "--device", "cpu",
                          "--max-model-len", "256", "--tensor-parallel-size", "2", "--num-replicas", "2",
                          "--routing", "prefix", "--accelerator-resource", ACCELERATOR,
                          "--accelerator-per-rank", "1", "--cpus-per-rank", str(CPUS_PER_RANK))
    try:
        wait_until_healthy(server, port, log)
        yield server, port, log
    finally:
        stop(server)


def test_replicas_ranks_ingress_and_proxy_land_where_the_settings_say(ray_nodes, joined_server):
    _, port, _ = joined_server
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    where = ray_nodes.report_when_running("LLMServer", 2)
    replicas = where["replicas"]["LLMServer"]
    assert len(replicas) == 2 and {r["state"] for r in replicas} == {"RUNNING"}, replicas
    # one replica per accelerator node: a node holds 2 accelerators, a replica takes 2
    assert sorted(r["node_id"] for r in replicas) == sorted(ray_nodes.workers)
    groups = [g for g in where["placement_groups"] if len(g["bundles"]) == 2]
    assert len(groups) == 2, where["placement_groups"]
    for group in groups:  # each replica's two ranks, packed on one worker node
        assert group["strategy"] == "STRICT_PACK" and group["state"] == "CREATED"
        assert len(group["nodes"]) == 1 and group["nodes"][0] in ray_nodes.workers
        assert all(b == {"CPU": CPUS_PER_RANK, ACCELERATOR: 1.0} for b in group["bundles"]), group
    # the ingress asks for CPUs only, and the workers have none left: it runs on the head, with the proxy
    assert [r["node_id"] for r in where["replicas"]["OpenAIIngress"]] == [ray_nodes.head]
    assert where["proxies"] == [ray_nodes.head]


def test_sigterm_deletes_the_application_and_leaves_the_joined_cluster_running(ray_nodes, joined_server):
    server, _, log = joined_server
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=90) == 0, log.read_text()[-3000:]
    assert "drained in" in log.read_text() and "did not report" not in log.read_text()
    where = ray_nodes.report()  # the cluster answers, without our application
    assert where["replicas"] == {}
    assert not [g for g in where["placement_groups"] if len(g["bundles"]) == 2]
