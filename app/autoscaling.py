"""Replica autoscaling on engine queue depth: waiting + running sequences per replica, plus router-queued requests.

Each replica reports `engine_queue_depth` through the deployment's `record_autoscaling_stats()`. The policy asks
for enough replicas that each holds about `target_queue_depth`; Serve applies min/max replicas and the
upscale/downscale delays around it.
"""

from __future__ import annotations

import math
from typing import Any

QUEUE_DEPTH_METRIC = "engine_queue_depth"
METRICS_INTERVAL_S = 0.5  # how often replicas push metrics (Serve's default, 10 s, makes scaling lag by ~8 s)
LOOK_BACK_PERIOD_S = 2.0  # metrics are averaged over this window before the policy sees them


class QueueDepthPolicy:
    """Serve autoscaling policy: desired replicas = ceil(total queue depth / target_queue_depth)."""

    # no default: Serve passes autoscaling_config's policy_kwargs, ServeArgs.target_queue_depth (its one default)
    def __init__(self, target_queue_depth: float):
        self.target_queue_depth = target_queue_depth

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        depth = total_queue_depth(ctx)
        desired = math.ceil(depth / self.target_queue_depth)
        desired = max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas, desired))
        return desired, {"queue_depth": depth}


def total_queue_depth(ctx: Any) -> float:
    """Engine queue depth summed over running replicas, plus requests still queued in Serve's routers."""
    per_replica = (ctx.aggregated_metrics or {}).get(QUEUE_DEPTH_METRIC) or {}
    if not per_replica:  # no replica has reported yet: fall back to Serve's own request count
        return float(ctx.total_num_requests or 0)
    return float(sum(per_replica.values())) + float(ctx.total_queued_requests or 0)


def autoscaling_config(min_replicas: int, max_replicas: int, target_queue_depth: float,
                       upscale_delay_s: float, downscale_delay_s: float) -> dict[str, Any]:
    """The `autoscaling_config` deployment option for these bounds (a dict, as serve.yaml would hold it)."""
    return {
        "min_replicas": min_replicas,
        "initial_replicas": max(min_replicas, 1),
        "max_replicas": max_replicas,
        "upscale_delay_s": upscale_delay_s,
        "downscale_delay_s": downscale_delay_s,
        "metrics_interval_s": METRICS_INTERVAL_S,
        "look_back_period_s": LOOK_BACK_PERIOD_S,
        "policy": {
            "policy_function": f"{__name__}:QueueDepthPolicy",
            "policy_kwargs": {"target_queue_depth": target_queue_depth},
        },
    }
