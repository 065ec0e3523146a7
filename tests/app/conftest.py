"""One local Ray + Serve per test session (127.0.0.1 only), the tiny model served through the real HTTP path."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import pytest

from app.config import ServeArgs
from app.proxy_errors import use_openai_errors_in_serve_proxy

API_KEY = "test-key"
SERVED_NAME = "tiny"
MAX_MODEL_LEN = 512


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServeCluster:
    port: int

    def url(self, route_prefix: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{route_prefix}"


@pytest.fixture(scope="session")
def serve_cluster():
    """Local Ray (every port on loopback) and Serve's HTTP proxy on a free 127.0.0.1 port."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    use_openai_errors_in_serve_proxy()  # as `shardserve serve` does
    import ray
    from ray import serve

    # address="local": a fresh cluster of our own even when other Ray clusters run on this machine
    ray.init(address="local", include_dashboard=False, num_cpus=4, logging_level=logging.WARNING, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield ServeCluster(port)
    finally:
        serve.shutdown()
        ray.shutdown()


def tiny_serve_args(model_dir, **overrides) -> ServeArgs:
    fields = dict(model=str(model_dir), served_model_name=SERVED_NAME, dtype="float32", max_model_len=MAX_MODEL_LEN,
                  max_num_seqs=64, max_request_body_bytes=16384, cpus_per_rank=0.5, num_replicas=1,
                  api_key=API_KEY)
    return ServeArgs(**(fields | overrides))


@pytest.fixture(scope="session")
def served_tiny(serve_cluster, tiny_llama_dir):
    """The tiny Llama behind Serve at route prefix "/" (one replica, API key required)."""
    from ray import serve

    from app.deployment import build_app

    handle = serve.run(build_app(tiny_serve_args(tiny_llama_dir)), name="tiny", route_prefix="/")
    yield serve_cluster, handle
    serve.delete("tiny")


@pytest.fixture(scope="session")
def offline_llm(tiny_llama_dir):
    """The in-process engine on the same weights: the expected greedy text."""
    from engine import LLM

    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()
