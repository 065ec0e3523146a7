"""Engine and sampling configuration: every knob, its default and its validation in one place."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.errors import InvalidRequestError, ModelLoadError

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


class ModelConfig(BaseModel):
    """The parts of a Hugging Face config.json the engine needs."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    architecture: Literal["llama", "qwen2", "qwen3"]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    checkpoint_format: Literal["safetensors", "gguf"] = "safetensors"

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """From a Hugging Face directory's config.json, or from a GGUF file's metadata (a `.gguf` path,
        or a directory holding one and no config.json; read once, then from engine/gguf_cache.py's cache)."""
        from engine.gguf import find_gguf_file
        from engine.gguf_cache import unpacked_config_fields

        if (gguf_file := find_gguf_file(model_dir)) is not None:
            return cls(**unpacked_config_fields(gguf_file))
        path = Path(model_dir)
        if not path.is_dir():
            raise ModelLoadError(f"model directory {str(path)!r} does not exist (models load from a local directory)")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelLoadError(f"{str(cfg_file)!r} is missing: not a Hugging Face model directory")
        raw = json.loads(cfg_file.read_text())
        model_type = raw.get("model_type")
        if model_type in ("llama", "mistral"):
            arch = "llama"
        elif model_type in ("qwen2", "qwen3"):
            arch = model_type
        else:
            raise ModelLoadError(
                f"model_type {model_type!r} is not supported (supported: llama, mistral, qwen2, qwen3)"
            )
        num_heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        gen_cfg = path / "generation_config.json"
        if gen_cfg.is_file():
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=raw.get("rope_scaling") or _rope_scaling_from_parameters(raw.get("rope_parameters")),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # transformers' defaults: Qwen2 always has q/k/v bias, Qwen3 has none unless it says so
            attention_bias=raw.get("attention_bias", arch == "qwen2"),
            mlp_bias=raw.get("mlp_bias", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        )


def _rope_scaling_from_parameters(params: dict | None) -> dict | None:
    """transformers 5 writes rope settings as `rope_parameters`; only a non-default type is scaling."""
    if not params or params.get("rope_type", "default") == "default":
        return None
    return params


class EngineConfig(BaseModel):
    """Everything one engine replica needs to start. Names follow vLLM's engine arguments."""

    model_config = ConfigDict(extra="forbid")

    model: str
    tokenizer: str | None = None
    dtype: Literal["auto", "float32", "float", "bfloat16", "float16", "half"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    block_size: int = Field(16, ge=1, le=256)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_gb: float | None = Field(None, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    seed: int = 0
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    swap_space: float = Field(4.0, ge=0)
    tensor_parallel_size: int = Field(1, ge=1)
    kernel_backend: Literal["auto", "cpu", "torch", "triton"] = "auto"
    # torch threads per rank on CPU; None: the cores this process may run on, shared by the ranks
    cpu_threads: int | None = Field(None, ge=1)
    watermark: float = Field(0.01, ge=0, lt=1)

    @field_validator("block_size")
    @classmethod
    def _block_size_power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block_size must be a power of two, got {v}")
        return v

    @model_validator(mode="after")
    def _check_limits(self) -> EngineConfig:
        if self.tensor_parallel_size not in (1, 2, 4, 8):
            raise ValueError(f"tensor_parallel_size must be 1, 2, 4 or 8, got {self.tensor_parallel_size}")
        if self.num_kv_blocks is not None and self.kv_cache_memory_gb is not None:
            raise ValueError("set at most one of num_kv_blocks and kv_cache_memory_gb")
        return self

    def resolved_cpu_threads(self) -> int:
        """torch threads for one rank's CPU ops. Set explicitly, never inherited: Ray sets an actor's
        OMP_NUM_THREADS to its logical CPUs (1 per rank by default), which left a served replica
        running on one of two cores."""
        if self.cpu_threads:
            return self.cpu_threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores // self.tensor_parallel_size)

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, model_config: ModelConfig) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if model_config.checkpoint_format == "gguf":
            return self._preferred_dtype()  # dequantized: no dtype of its own
        dtype = _DTYPES.get(model_config.torch_dtype or "float32", torch.float32)
        if self.resolved_device().type == "cpu" and dtype == torch.float16:
            return torch.bfloat16  # float16 matmuls are slow and imprecise on CPU
        return dtype

    def _preferred_dtype(self) -> torch.dtype:
        """bfloat16 where the hardware multiplies it natively (CUDA, AVX512-BF16 or AMX CPUs), else float32."""
        from kernels.backend import cpu_supports_bf16

        if self.resolved_device().type == "cuda" or cpu_supports_bf16():
            return torch.bfloat16
        return torch.float32

    def resolve(self, model_config: ModelConfig) -> int:
        """Check this config against the model; returns the context length it serves (max_model_len)."""
        tp = self.tensor_parallel_size
        if model_config.num_attention_heads % tp:
            raise ValueError(
                f"num_attention_heads ({model_config.num_attention_heads}) must be divisible by "
                f"tensor_parallel_size ({tp})"
            )
        kv = model_config.num_key_value_heads
        if kv % tp and tp % kv:
            raise ValueError(
                f"num_key_value_heads ({kv}) and tensor_parallel_size ({tp}) must divide one another"
            )
        max_model_len = self.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings and not model_config.rope_scaling:
            raise ValueError(
                f"max_model_len ({max_model_len}) is over the model's max_position_embeddings "
                f"({model_config.max_position_embeddings})"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be at least max_model_len ({max_model_len})"
            )
        return max_model_len


class SamplingParams(BaseModel):
    """How to pick tokens for one request (vLLM's names and meanings)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    n: int = 1
    max_tokens: int | None = 16  # None: the rest of the context (resolved when the engine takes the request)
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    skip_special_tokens: bool = True

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v):
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be at least 0, got {self.min_tokens}"),
            (self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 (off) or at least 1, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (0 < self.repetition_penalty <= 2, f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (all(s for s in self.stop), "stop strings must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
