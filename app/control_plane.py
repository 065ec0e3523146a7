"""How often Ray's and Serve's own processes wake up: the `--control-plane` profiles.

On a CPU node the engine computes on the same cores as the GCS, the raylet, Serve's controller and the replica's
Ray threads, and every periodic wake-up of theirs is a context switch there. Their periods are made for GPU
fleets, where those cores are idle: the raylet reports its resources every 100 ms and checks for garbage every
100 ms, the memory monitor reads /proc every 250 ms, Serve's controller runs its loop every 100 ms and each replica
flushes its cached request metrics every 100 ms. `quiet` makes each an order of magnitude slower where what it
costs is bounded and measured (docs/BENCHMARKS.md "Serving path: direct ingress, quiet control plane, held deltas"):
- the controller's loop: it notices a dead replica and acts on an autoscaling decision at most 0.5 s later,
  against replacement times of seconds and autoscaling delays of 2-10 s;
- the raylet's resource report: a new replica's placement group is seen up to 1 s later;
- the memory monitor: an out-of-memory kill comes up to 1 s later;
- Serve's request metrics in Ray's export are at most 1 s old (they are scraped every 5 s or more).
Health checks keep their periods (ServeArgs.health_check_period_s): they decide recovery time.

Ray reads its settings (RAY_<name>) and Serve its own (RAY_SERVE_*) once, when each process starts, from its
environment: `shardserve serve` sets them before it starts its own local Ray, and a cluster started otherwise
(`ray start`, KubeRay) takes them from its environment (configs/serve.yaml, configs/rayservice.yaml).
"""

from __future__ import annotations

import os
from typing import Literal

ControlPlane = Literal["default", "quiet"]

QUIET_ENV: dict[str, str] = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",  # 0.1
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",  # 100
    "RAY_raylet_report_resources_period_milliseconds": "1000",  # 100
    "RAY_raylet_check_gc_period_milliseconds": "1000",  # 100
    "RAY_memory_monitor_refresh_ms": "1000",  # 250
}

PROFILES: dict[str, dict[str, str]] = {"default": {}, "quiet": QUIET_ENV}


def control_plane_env(profile: ControlPlane) -> dict[str, str]:
    """The environment of every Ray process for this profile (empty: Ray's and Serve's own periods)."""
    return dict(PROFILES[profile])


def apply_control_plane(profile: ControlPlane) -> None:
    """Set the profile in this process's environment, before it starts Ray; a value already there is kept (an
    operator's own setting wins)."""
    for name, value in control_plane_env(profile).items():
        os.environ.setdefault(name, value)
