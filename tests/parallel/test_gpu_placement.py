"""Where each rank of a GPU engine runs, checked on a Ray with two fake GPUs (tests/parallel/fake_gpu_cluster.py,
in its own process): bundles, rank 0's GPU, each rank's CUDA_VISIBLE_DEVICES and device, the rendezvous
address, and the device a Serve replica asks for. The pure rules (engine/executor/gpu_devices.py,
app/replica_device.py) are checked here directly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.config import ServeArgs
from app.deployment import REPLICA_SERVE_ENV
from app.replica_device import ReplicaDeviceError, replica_device
from engine.executor import gpu_devices
from engine.executor.gpu_devices import (
    GpuPlacementError,
    RankPlace,
    check_distinct_gpus,
    cuda_index,
    rendezvous_host,
)

PROBE = Path(__file__).with_name("fake_gpu_cluster.py")
REPORT = "fake-gpu-report: "


@pytest.fixture(scope="module")
def fake_gpus() -> dict:
    """The probe's report (one Ray start for the module)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "RAY_ADDRESS")}
    done = subprocess.run([sys.executable, str(PROBE)], capture_output=True, text=True, timeout=240, env=env,
                          cwd=PROBE.parents[2])
    lines = [line for line in done.stdout.splitlines() if line.startswith(REPORT)]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix(REPORT))


@pytest.mark.timeout(300)
def test_an_offline_engine_puts_rank_0s_bundle_on_the_drivers_node_and_runs_rank_0_on_its_gpu(fake_gpus):
    offline = fake_gpus["offline"]
    node = offline["node_ip"]
    assert offline["bundles"] == [{"GPU": 1.0, f"node:{node}": 0.001}, {"GPU": 1.0}]
    rank0, rank1 = offline["ranks"]
    assert offline["driver_gpu_ids"] == []  # the driver holds nothing: bundle 0's GPU is held for it
    assert len(rank0["gpu_ids"]) == len(rank1["gpu_ids"]) == 1 and rank0["gpu_ids"] != rank1["gpu_ids"]
    assert {rank0["cuda_index"], rank1["cuda_index"]} == {0, 1}


@pytest.mark.timeout(300)
def test_every_gpu_rank_sees_the_nodes_gpus_and_takes_the_one_ray_reserved(fake_gpus):
    rank1 = fake_gpus["offline"]["ranks"][1]
    assert rank1["visible_devices"] is None  # not narrowed to its own GPU (NCCL needs to see its peers')
    assert rank1["cuda_index"] == int(rank1["gpu_ids"][0])


@pytest.mark.timeout(300)
def test_the_rendezvous_address_is_rank_0s_node_as_ray_reports_it(fake_gpus):
    offline = fake_gpus["offline"]
    assert offline["rendezvous"] == offline["ranks"][0]["node_ip"] == offline["node_ip"]
    assert offline["ranks"][1]["node_ip"] == offline["node_ip"]


@pytest.mark.timeout(300)
def test_a_device_auto_deployment_asks_for_gpus_where_the_ray_cluster_has_them(fake_gpus):
    """Built in a process whose torch sees no GPU (as on a KubeRay head): the cluster's GPUs decide."""
    serve = fake_gpus["serve"]
    assert serve["bundles"] == [{"CPU": 1.0, "GPU": 1.0}] * 2
    options = serve["ray_actor_options"]
    assert options["num_gpus"] == 1
    assert options["runtime_env"]["env_vars"] == {gpu_devices.NOSET_VISIBLE_DEVICES: "1", **REPLICA_SERVE_ENV}


def test_a_replica_given_a_gpu_it_cannot_use_fails_loudly_instead_of_serving_on_cpu(monkeypatch):
    monkeypatch.setattr("app.replica_device.reserved_gpu_ids", lambda: ("3",))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ReplicaDeviceError, match="Ray reserved GPU 3 for this replica .* sees no CUDA device"):
        replica_device(ServeArgs(device="auto"))


def test_a_replica_decides_auto_from_what_ray_reserved_for_it(monkeypatch):
    monkeypatch.setattr("app.replica_device.reserved_gpu_ids", lambda: ())
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # a GPU node, but none of its GPUs is ours
    assert replica_device(ServeArgs(device="auto")) == "cpu"
    monkeypatch.setattr("app.replica_device.reserved_gpu_ids", lambda: ("1",))
    assert replica_device(ServeArgs(device="auto")) == "cuda"
    assert replica_device(ServeArgs(device="cpu")) == "cpu"


def test_a_gpus_torch_index_is_its_ray_id_looked_up_in_the_processs_visible_devices():
    assert cuda_index("3", None) == 3
    assert cuda_index("3", "2,3") == 1  # Ray's ids are the node's; torch counts the visible ones
    assert cuda_index("GPU-b1", "GPU-a0,GPU-b1") == 1
    with pytest.raises(GpuPlacementError, match="sees CUDA_VISIBLE_DEVICES='0'"):
        cuda_index("1", "0")


def test_ranks_on_different_nodes_or_sharing_a_gpu_are_refused_before_any_group_forms():
    here, there = RankPlace(0, "10.0.0.1", ("0",), None), RankPlace(1, "10.0.0.2", ("1",), None)
    with pytest.raises(GpuPlacementError, match=r"rank\(s\) \[1\] run on another node than rank 0 \(10.0.0.1\)"):
        rendezvous_host([here, there])
    assert rendezvous_host([here, RankPlace(1, "10.0.0.1", ("1",), None)]) == "10.0.0.1"
    with pytest.raises(GpuPlacementError, match="ranks 0 and 1 were both given GPU 0"):
        check_distinct_gpus([here, RankPlace(1, "10.0.0.1", ("0",), None)])


def test_the_nccl_group_is_bound_to_the_ranks_own_gpu_from_the_start(monkeypatch):
    """torch's ProcessGroupNCCL, stood in for (this torch has no NCCL): made, then connected on the rank's device."""
    import torch
    import torch.distributed as dist

    from parallel.state import init_parallel_context

    made = []

    class FakeNCCL:
        Options = type("Options", (), {})

        def __init__(self, store, rank, world_size, options):
            made.append(self)
            self.connected_on = None

        def eager_connect_single_device(self, device):
            self.connected_on = device

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    context = init_parallel_context(dist.HashStore(), 0, 1, "cuda", device=torch.device("cuda", 3))
    assert made == [context.group] and context.group.connected_on == torch.device("cuda", 3)
    with pytest.raises(ValueError, match="needs this rank's CUDA device"):
        init_parallel_context(dist.HashStore(), 0, 1, "cuda")
