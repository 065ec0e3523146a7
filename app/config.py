"""ServeArgs: the one settings model behind `shardserve serve`, configs/serve.yaml and the RayService."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.config import EngineConfig

SERVE_CPU_BATCHED_TOKENS = 2048
SamplingDefault = Literal[
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"
]


class ServeArgs(BaseModel):
    """Flat, vLLM-named settings for one served model (CLI flags use dashes: --max-num-seqs)."""

    model_config = ConfigDict(extra="forbid")

    # model and engine
    model: str | None = None  # local HF directory or .gguf file; None = the demo model (engine/demo_model.py)
    served_model_name: str | None = None
    tensor_parallel_size: int = Field(1, ge=1)
    dtype: Literal["auto", "float32", "float", "bfloat16", "float16", "half"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_num_seqs: int = Field(256, ge=1)
    # tokens per engine step; None: 2048 on CPU (vLLM's CPU API-server default: short steps keep
    # first tokens and streams moving), 8192 on GPU
    max_num_batched_tokens: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    block_size: int = Field(16, ge=1)
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_gb: float | None = Field(None, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enable_prefix_caching: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    swap_space: float = Field(4.0, ge=0)
    seed: int = 0
    # sampling defaults for requests that leave a field out, e.g. {"temperature": 0.2} (vLLM's flag);
    # None: the neutral values (temperature 1), or for the demo model its model card's recommendation
    override_generation_config: dict[SamplingDefault, float] | None = None
    kernel_backend: Literal["auto", "cpu", "torch", "triton"] = "auto"
    # torch threads per rank on CPU; None: the cores this process may run on, shared by the ranks
    cpu_threads: int | None = Field(None, ge=1)
    # HTTP
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    api_key: str | None = None
    max_request_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    # stream batching (app/api.py StreamBatching): a stream's SSE events are written at most every
    # stream_interval_ms, stretched so the replica's streams make at most max_stream_writes_per_s
    # writes a second; the events in between are joined. 0 and 0: every event written as it comes.
    stream_interval_ms: float = Field(50.0, ge=0)
    max_stream_writes_per_s: float = Field(200.0, ge=0)
    # replicas and autoscaling
    num_replicas: int | None = Field(None, ge=1)
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_queue_depth: float = Field(8.0, gt=0)
    upscale_delay_s: float = Field(2.0, ge=0)
    downscale_delay_s: float = Field(10.0, ge=0)
    max_ongoing_requests: int | None = Field(None, ge=1)
    max_waiting_requests: int = Field(256, ge=0)
    cpus_per_rank: float = Field(1.0, gt=0)
    # observability
    otlp_traces_endpoint: str | None = None

    @model_validator(mode="after")
    def _check_replicas(self) -> ServeArgs:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})")
        return self

    def engine_config(self, model_dir: str) -> EngineConfig:
        """The EngineConfig each replica starts with."""
        fields = set(EngineConfig.model_fields) - {"model"}
        settings = {k: v for k, v in self.model_dump().items() if k in fields}
        if settings["max_num_batched_tokens"] is None:
            on_cpu = EngineConfig(model=model_dir, device=self.device).resolved_device().type == "cpu"
            default = EngineConfig.model_fields["max_num_batched_tokens"].default
            settings["max_num_batched_tokens"] = SERVE_CPU_BATCHED_TOKENS if on_cpu else default
        return EngineConfig(model=model_dir, **settings)
