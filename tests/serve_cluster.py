"""A local Ray with Serve's HTTP proxy on a free 127.0.0.1 port: the session's `serve_cluster` (tests/conftest.py)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from app.config import ServeArgs
from app.control_plane import apply_control_plane
from app.proxy_errors import use_openai_errors_in_serve_proxy
from scripts.ports import free_port  # noqa: F401 — the tests import it from here


@dataclass
class ServeCluster:
    port: int

    def url(self, route_prefix: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{route_prefix}"


# The cluster local_serve_cluster is running in this process, if any (tests/conftest.py leaves its Ray up).
RUNNING: list[ServeCluster] = []


@contextmanager
def local_serve_cluster(num_cpus: int = 4) -> Iterator[ServeCluster]:
    """Start a local Ray (every port on loopback) and Serve; shut both down on leaving."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    use_openai_errors_in_serve_proxy()  # as `shardserve serve` does
    apply_control_plane(ServeArgs.model_fields["control_plane"].default)  # and with its default periods
    import ray
    from ray import serve

    if ray.is_initialized():  # a Ray that an offline TP engine of this module started for itself (ensure_ray)
        ray.shutdown()
    # address="local": a fresh cluster of our own even when other Ray clusters run on this machine
    ray.init(address="local", include_dashboard=False, num_cpus=num_cpus, logging_level=logging.WARNING,
             log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    cluster = ServeCluster(port)
    RUNNING.append(cluster)
    try:
        yield cluster
    finally:
        RUNNING.remove(cluster)
        serve.shutdown()
        ray.shutdown()
