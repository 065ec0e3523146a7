"""A checkpoint's ModelConfig: from a Hugging Face directory's config.json, or from a GGUF file's metadata."""

from __future__ import annotations

import json
from pathlib import Path

from engine.checkpoint.gguf import find_gguf_file
from engine.checkpoint.gguf_cache import unpacked_config_fields
from engine.config import ModelConfig
from engine.errors import ModelLoadError


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """From a Hugging Face directory's config.json, or from a GGUF file's metadata (a `.gguf` path, or a
    directory holding one and no config.json; read once, then from the cache of gguf_cache.py)."""
    if (gguf_file := find_gguf_file(model_dir)) is not None:
        return ModelConfig(**unpacked_config_fields(gguf_file))
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
    return ModelConfig(
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
