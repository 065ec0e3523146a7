"""RoutingConfig: the settings of the prefix-aware, load-aware request router (issue 17)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

RoutingMode = Literal["prefix", "load", "serve-default"]


class RoutingConfig(BaseModel):
    """How requests are spread over engine replicas; the field descriptions are the CLI help."""

    model_config = ConfigDict(extra="forbid")

    mode: RoutingMode = Field("prefix", description=(
        "prefix: send a request to the replica that most likely holds its prompt's prefix in its KV cache, "
        "unless that replica is busier than the least-loaded one by more than --routing-max-imbalance; "
        "load: always the least-loaded replica (engine queue depth); "
        "serve-default: Ray Serve's own router (power of two choices on ongoing requests)"))
    min_match_blocks: int = Field(1, ge=1, description=(
        "fewest full KV blocks of cached prefix that make a replica preferred over the least-loaded one"))
    max_imbalance: int = Field(16, ge=0, description=(
        "how many more queued and running sequences than the least-loaded replica the prefix's replica may "
        "have and still get the request; past it (and past --routing-max-imbalance-ratio) the least-loaded "
        "replica gets it instead (a full replica is skipped either way)"))
    max_imbalance_ratio: float = Field(1.5, ge=1.0, description=(
        "...and how many times the least-loaded replica's load: both bounds must be passed before a request "
        "leaves its prefix's replica (as SGLang's and vLLM's routers do), so an idle replica next to a busy "
        "one draws work, and at large batches a small difference keeps the cache hit"))
    ttl_s: float = Field(300.0, gt=0, description=(
        "seconds after which the router forgets that it sent a prefix to a replica (about how long a "
        "replica's prefix cache keeps an unused prefix)"))
    max_blocks_per_replica: int = Field(16384, ge=1, description=(
        "most prefix blocks the router remembers per replica, least recently used forgotten first; about "
        "the replica's KV-cache size in blocks"))
    block_size: int = Field(16, ge=1, description=(
        "tokens per prefix block: must equal the engine's --block-size, or no prefix ever matches"))
    stats_period_s: float = Field(1.0, gt=0, description=(
        "seconds between a replica's load reports to the routers (Serve's request_routing_stats_period_s)"))
