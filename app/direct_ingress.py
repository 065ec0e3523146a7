"""Serve's direct ingress: the application's one ingress replica answers HTTP on --port itself, with no Serve
proxy between the client and it.

Behind Serve's proxy every request is two processes' work: the proxy parses HTTP and hands each request, and
every streamed message back, across an actor call to the replica. On a CPU node the proxy's wake-ups land on the
cores the engine computes on (docs/BENCHMARKS.md, "Serving path: where a replica's CPU goes"). Ray Serve 2.60's
direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS) starts an HTTP server inside each ingress replica instead, on a port that the
controller hands out from a range, with the proxy middlewares (app/proxy_errors.py) around the app as in the
proxy; the controller still starts one Serve proxy on the head node, for load balancers to fall back on.

For `shardserve serve` that range is --port alone, so the one ingress replica (LLMServer where it is the only
replica, else OpenAIIngress) listens where clients connect, and the head's proxy is moved off it, to a port the
system picks as it binds. Serve reads these settings once per process, at import, so they must be in the
environment of every Ray process: the CLI sets them before it starts its own local Ray, and a cluster started
with `ray start` needs them exported first (docs/OPERATIONS.md, "HTTP ingress").

It holds only where there is exactly one ingress replica for the whole time: several on one node cannot share
the port, and with none (scaled to zero) nothing listens on it. Where that is not so, `auto` keeps the proxy and
`direct` is refused with the reason.
"""

from __future__ import annotations

import os
import socket
import types
from typing import Literal

from app.config import ServeArgs

HttpIngress = Literal["direct", "proxy"]

# what Serve's controller and replicas read at import (ray/serve/_private/constants.py)
ENABLE_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
MIN_PORT_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"
MAX_PORT_ENV = "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"  # the range excludes its end: max = port + 1
# after Serve's own stop of a replica, how long its server keeps answering for a load balancer to notice (30 s by
# default): `shardserve serve` drains first (app/drain.py), so nothing is left to wait for
MIN_DRAINING_PERIOD_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
# how long a stopped replica's port stays out of the pool (HAProxy's reloads need that; one port cannot wait)
PORT_QUARANTINE_ENV = "RAY_SERVE_PORT_QUARANTINE_S"
# a function Serve's controller calls as it starts (ray/serve/_private/controller.py)
CONTROLLER_CALLBACK_ENV = "RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH"
NO_HEAD_PROXY = "app.direct_ingress:no_head_proxy"


def single_ingress_replica_reason(args: ServeArgs) -> str | None:
    """None where the application's ingress has exactly one replica at all times, else why not."""
    if args.routing_config() is not None:  # OpenAIIngress in front of the engine replicas
        if args.ingress_replicas != 1:
            return f"--ingress-replicas is {args.ingress_replicas}: replicas on one node cannot share one port"
        return None
    if args.num_replicas is not None:
        replicas = (args.num_replicas, args.num_replicas)
    else:
        replicas = (args.min_replicas, args.max_replicas)
    if replicas == (1, 1):
        return None
    if replicas[0] == 0:
        return "--min-replicas 0: with no replica, nothing would listen on --port"
    return ("several LLMServer replicas with --routing serve-default: they cannot share one port (the prefix or "
            "load routing puts one ingress in front of them)")


def resolve_http_ingress(args: ServeArgs, own_cluster: bool) -> HttpIngress:
    """What serves HTTP for these settings. `auto` is direct on a local Ray of our own where there is one ingress
    replica; on a joined cluster Serve's processes were started without the settings, so the proxy stays.
    Raises ValueError where `direct` was asked for and cannot hold."""
    reason = single_ingress_replica_reason(args)
    if args.http_ingress == "proxy":
        return "proxy"
    if args.http_ingress == "direct":
        if reason is not None:
            raise ValueError(f"--http-ingress direct needs exactly one ingress replica: {reason}")
        return "direct"
    return "direct" if own_cluster and reason is None else "proxy"


def direct_ingress_env(port: int) -> dict[str, str]:
    """Serve's settings for direct ingress on `port` alone."""
    return {
        ENABLE_ENV: "1",
        MIN_PORT_ENV: str(port),
        MAX_PORT_ENV: str(port + 1),
        MIN_DRAINING_PERIOD_ENV: "0",
        PORT_QUARANTINE_ENV: "0",
    }


def no_head_proxy() -> None:
    """Serve's controller callback (RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH), run in the controller's process as
    it starts: no node gets a Serve proxy. (`proxy_location="Disabled"` itself would also turn off the replica's
    own HTTP server.)

    With direct ingress Serve 2.60's controller overrides the proxy location with HeadOnly, to keep one proxy on
    the head node for a load balancer to fall back on. `shardserve serve` moves that proxy to a port the system
    picks, so nothing can reach it, but its process still wakes ~200 times a second on the cores the engine computes
    on (Ray's core worker threads); stopping it measured +1-5% served throughput at concurrency 50
    (docs/BENCHMARKS.md, "Serving path: one event loop in the replica, no idle proxy"). Where Serve's proxy manager
    has no `_get_target_nodes` (another version), the proxy stays and nothing else changes."""
    from ray.serve._private import proxy_state

    manager = proxy_state.ProxyStateManager
    if getattr(manager, "shardserve_no_proxies", False) or not hasattr(manager, "_get_target_nodes"):
        return
    manager._get_target_nodes = lambda self, proxy_nodes: []
    manager.shardserve_no_proxies = True


def reuse_the_port_of_a_dead_replica() -> None:
    """Serve 2.60 binds a replica's direct-ingress socket without SO_REUSEADDR, so after a replica's process died
    with connections open (their server side then waits in TIME_WAIT for a minute), its replacement cannot bind
    the one port: Serve blocks the port and the replica fails to start until TIME_WAIT ends (measured: no answer
    for over 60 s after a replica was killed mid-stream). Have Serve's sockets in this replica process set it, as
    uvicorn's own do. Runs in the replica's constructor, before Serve starts the server."""
    from ray.serve._private import http_util

    if os.environ.get(ENABLE_ENV) != "1" or getattr(http_util.socket, "shardserve_reuse_address", False):
        return

    class ReusableAddressSocket(socket.socket):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    shim = types.ModuleType("socket")
    shim.__dict__.update(socket.__dict__)
    shim.socket = ReusableAddressSocket
    shim.shardserve_reuse_address = True
    http_util.socket = shim
