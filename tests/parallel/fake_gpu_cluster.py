"""Ray with two fake GPUs (`ray.init(num_gpus=2)` on a machine without any): where the tensor-parallel ranks
and a Serve replica would run, reported as JSON on the last line of stdout.

Run in its own process by tests/parallel/test_gpu_placement.py, since a process that already has a Ray
(the session's Serve cluster) cannot start one with GPUs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # the node's GPUs are Ray's 0 and 1

import ray  # noqa: E402

from app.config import ServeArgs  # noqa: E402
from app.deployment import deployment_options, placement_group_bundles  # noqa: E402
from engine.config import EngineConfig, ModelConfig  # noqa: E402
from engine.executor.gpu_devices import rendezvous_host  # noqa: E402
from engine.executor.ray_ranks import TensorParallelWorker, WorkerPlacement  # noqa: E402
from parallel.state import create_store  # noqa: E402

REPORT = "fake-gpu-report: "
MODEL = ModelConfig(
    architecture="llama", vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


def place_dict(place) -> dict:
    return dataclasses.asdict(place) | {"cuda_index": place.cuda_index}


def offline_tp2() -> dict:
    """An offline TP=2 engine's placement on CUDA, up to the point where the ranks would touch a GPU."""
    config = EngineConfig(model="unused", device="cuda", tensor_parallel_size=2)
    placement = WorkerPlacement.acquire(2, "cuda", ray.util.get_node_ip_address())
    worker = None
    try:
        rank0 = placement.rank0_place()
        store = create_store(2, host=rank0.node_ip)
        worker = TensorParallelWorker.options(**placement.actor_options(1)).remote(
            config, MODEL, 1, 2, rank0.node_ip, store.port, 256
        )
        rank1 = ray.get(worker.place.remote(), timeout=60)
        return {
            "bundles": placement.placement_group.bundle_specs,
            "driver_gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()],
            "node_ip": ray.util.get_node_ip_address(),
            "ranks": [place_dict(rank0), place_dict(rank1)],
            "rendezvous": rendezvous_host([rank0, rank1]),
        }
    finally:
        if worker is not None:
            ray.kill(worker)
        placement.release()


def serve_replica() -> dict:
    """A replica deployed with device auto on a Ray cluster with GPUs, built here where torch sees none."""
    args = ServeArgs(device="auto", tensor_parallel_size=2)
    options = deployment_options(args)
    return {"bundles": placement_group_bundles(args), "ray_actor_options": options["ray_actor_options"]}


def main() -> None:
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False)
    try:
        report = {"offline": offline_tp2(), "serve": serve_replica()}
    finally:
        ray.shutdown()
    print(REPORT + json.dumps(report))


if __name__ == "__main__":
    main()
