"""Engine and sampling configuration: every knob, its default and its validation in one place."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.cpu_binding import allowed_cores, check_setting, rank_lists
from engine.errors import InvalidRequestError

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


class ModelConfig(BaseModel):
    """The parts of a Hugging Face config.json the engine needs (engine/checkpoint/model_config.py reads them)."""

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

    @property
    def num_parameters(self) -> int:
        """Weights of the matrices (embedding, attention, MLP, LM head); norms and biases are too few to count."""
        h, heads, kv, d = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        per_layer = h * heads * d * 2 + h * kv * d * 2 + 3 * h * self.intermediate_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + head + self.num_hidden_layers * per_layer


class SpeculativeConfig(BaseModel):
    """Speculative decoding (vLLM's `--speculative-config` keys): a proposer guesses the next tokens of a
    decoding sequence, and one forward pass of the target model verifies them all (engine/spec_decode/)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft_model"] = "ngram"
    num_speculative_tokens: int = Field(ge=1, le=16)
    # n-gram prompt lookup: the longest suffix of n tokens (min <= n <= max) found earlier in the sequence.
    # vLLM's defaults: one bound given sets the other to it, neither gives 5 and 5 (_lookup_bounds)
    prompt_lookup_min: int = Field(5, ge=1, le=16)
    prompt_lookup_max: int = Field(5, ge=1, le=16)
    model: str | None = None  # the draft model's directory (method draft_model; same tokenizer as the target)
    # no speculation in a step with more running sequences than this (the batch is compute-bound there)
    disable_by_batch_size: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _lookup_bounds(cls, data):
        """As vLLM resolves them: only prompt_lookup_max (or only min) given, the other bound equals it."""
        if isinstance(data, dict):
            low, high = data.get("prompt_lookup_min"), data.get("prompt_lookup_max")
            if (low is None) != (high is None):
                data = {**data, "prompt_lookup_min": high if low is None else low,
                        "prompt_lookup_max": low if high is None else high}
        return data

    @model_validator(mode="after")
    def _check_method(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        if self.method == "draft_model" and self.model is None:
            raise ValueError("speculative method draft_model needs speculative_config.model (the draft's directory)")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model names a draft model, which method ngram does not take")
        return self


def cpu_auto_dtype(model_config: ModelConfig) -> torch.dtype:
    """What `--dtype auto` runs a 16-bit checkpoint in on this CPU (EngineConfig.torch_dtype)."""
    from kernels.backend import cpu_supports_bf16

    if cpu_supports_bf16():
        return torch.bfloat16
    free = available_memory_bytes()
    if free is not None and model_config.num_parameters * 4 > free // 2:
        return torch.bfloat16  # float32 weights would crowd out the KV cache and everything else
    return torch.float32


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_cores() -> int:
    """How many cores this process may run on (its CPU affinity, as a container's cpuset limits it)."""
    return len(allowed_cores())


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
    # the cores each rank's CPU threads are bound to: lists of cores, or unbound: none, or auto, which
    # `shardserve serve` resolves for the machine it starts Ray on (engine/cpu_binding.py)
    cpu_threads_bind: str = "auto"
    watermark: float = Field(0.01, ge=0, lt=1)
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding

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
        check_setting(self.cpu_threads_bind, self.tensor_parallel_size)
        lists = rank_lists(self.cpu_threads_bind)
        if self.cpu_threads is not None and lists is not None:
            if {len(cores) for cores in lists} != {self.cpu_threads}:
                raise ValueError(f"cpu_threads {self.cpu_threads} and cpu_threads_bind {self.cpu_threads_bind!r} "
                                 "disagree: a bound rank runs one thread per core of its list (set one of them)")
        if self.num_kv_blocks is not None and self.kv_cache_memory_gb is not None:
            raise ValueError("set at most one of num_kv_blocks and kv_cache_memory_gb")
        return self

    def resolved_cpu_threads(self, rank: int = 0) -> int:
        """torch threads for one rank's CPU ops. Set explicitly, never inherited: Ray sets an actor's
        OMP_NUM_THREADS to its logical CPUs (1 per rank by default), which left a served replica
        running on one of two cores. A bound rank runs one thread per core of its list."""
        if self.cpu_threads:
            return self.cpu_threads
        cores = self.rank_cpu_cores(rank)
        if cores:
            return len(cores)
        return max(1, available_cores() // self.tensor_parallel_size)

    def rank_cpu_cores(self, rank: int = 0) -> list[int] | None:
        """The cores rank `rank`'s CPU threads are bound to: its list, or None (unbound: "none", "auto", which
        only `shardserve serve` resolves into lists, or a GPU)."""
        lists = rank_lists(self.cpu_threads_bind)
        if lists is None or self.resolved_device().type != "cpu":
            return None
        return lists[rank]

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, model_config: ModelConfig) -> torch.dtype:
        """The dtype of weights and activations. `auto`: on CUDA the checkpoint's (bfloat16 for a dequantized
        GGUF); on CPU a float32 checkpoint stays float32, and a 16-bit one (or a GGUF) runs in bfloat16 where the
        CPU multiplies it natively (AVX512-BF16 or AMX), else in float32 where float32 weights fit in half the
        memory this machine has free (docs/BENCHMARKS.md, "On the AVX2 EPYC": float32 is the faster there, as
        bfloat16 is emulated), else in bfloat16."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        gguf = model_config.checkpoint_format == "gguf"
        checkpoint = None if gguf else _DTYPES.get(model_config.torch_dtype or "float32", torch.float32)
        if self.resolved_device().type == "cuda":
            return checkpoint or torch.bfloat16
        if checkpoint == torch.float32:
            return torch.float32
        return cpu_auto_dtype(model_config)

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


class StructuredOutputsParams(BaseModel):
    """A constraint on what a request may generate (vLLM's `StructuredOutputsParams`): exactly one of a JSON
    schema, any JSON object, a regular expression, a choice of strings, an EBNF grammar or a structural tag.

    The engine compiles it with xgrammar (engine/structured_output/) and masks every step's logits with it,
    so the output always matches; a constraint that does not compile is an InvalidRequestError (400)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    # a JSON schema (text or parsed); `json` as in vLLM (the attribute is `json_schema`: BaseModel has a `json`)
    json_schema: str | dict | None = Field(None, alias="json")
    json_object: bool | None = None  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF in xgrammar's (GBNF-like) dialect
    structural_tag: str | None = None  # xgrammar's structural tag, as JSON text
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsParams:
        kinds = self.kinds()
        if len(kinds) != 1:
            raise InvalidRequestError(
                "structured_outputs takes exactly one of json, json_object, regex, choice, grammar and "
                f"structural_tag, got {', '.join(kinds) or 'none'}",
                param="structured_outputs",
            )
        if self.choice is not None and not self.choice:
            raise InvalidRequestError("structured_outputs.choice must not be empty", param="structured_outputs")
        return self

    def kinds(self) -> list[str]:
        """The constraints set, by their vLLM names."""
        names = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
        set_names = [name for name in names if getattr(self, name) not in (None, False)]
        return ["json" if name == "json_schema" else name for name in set_names]

    @property
    def kind(self) -> str:
        return self.kinds()[0]


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
    # token id -> bias added to its logit before the structured-output mask and sampling (OpenAI: -100..100)
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v):
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        """Each rule once, as (the field it is about, whether it holds, what to change)."""
        checks = [
            ("n", self.n >= 1, f"n must be at least 1, got {self.n}"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            ("min_tokens", self.min_tokens >= 0, f"min_tokens must be at least 0, got {self.min_tokens}"),
            ("temperature", self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}"),
            ("top_p", 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            ("top_k", self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 (off) or at least 1, got {self.top_k}"),
            ("min_p", 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            ("repetition_penalty", 0 < self.repetition_penalty <= 2,
             f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20,
             f"logprobs must be in [0, 20], got {self.logprobs}"),
            ("stop", all(s for s in self.stop), "stop strings must not be empty"),
            ("logit_bias", all(-100 <= b <= 100 for b in (self.logit_bias or {}).values()),
             "logit_bias values must be in [-100, 100]"),
        ]
        for param, ok, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
