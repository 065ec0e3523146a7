"""Write a GGUF checkpoint out as a Hugging Face directory (config.json, safetensors, tokenizer).

    python -m scripts.gguf_to_hf FILE.gguf OUT_DIR [--dtype bfloat16]

For peers that cannot read a GGUF file on CPU (vLLM's CPU build): the weights are the ones shardserve
serves from the same file, dequantized by engine/checkpoint/gguf.py, so a side by side compares engines, not
dequantizers. (transformers' own GGUF loader cannot save what it loads.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.checkpoint.gguf import gguf_checkpoint_tensors
from engine.checkpoint.gguf_cache import unpacked_tokenizer
from engine.checkpoint.model_config import load_model_config
from engine.config import ModelConfig

HF_MODEL_TYPES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
                  "qwen3": ("qwen3", "Qwen3ForCausalLM")}


def hf_config(config: ModelConfig, dtype: str) -> dict:
    model_type, architecture = HF_MODEL_TYPES[config.architecture]
    fields = dict(
        model_type=model_type, architectures=[architecture], vocab_size=config.vocab_size,
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias, mlp_bias=config.mlp_bias, hidden_act="silu",
        bos_token_id=config.bos_token_id, eos_token_id=_eos(config), torch_dtype=dtype,
    )
    if config.rope_scaling:
        if config.rope_scaling.get("rope_type") != "linear":
            raise SystemExit(f"rope scaling {config.rope_scaling.get('rope_type')!r} has no config.json form here")
        fields["rope_scaling"] = config.rope_scaling
    return fields


def _eos(config: ModelConfig) -> int | list[int] | None:
    """One id as an int (transformers' generate rejects a one-element list beside an int pad id)."""
    ids = list(config.eos_token_ids)
    return ids[0] if len(ids) == 1 else (ids or None)


def convert(gguf_file: Path, out: Path, dtype: str = "bfloat16") -> Path:
    config = load_model_config(gguf_file)
    out.mkdir(parents=True, exist_ok=True)
    weights = {
        name: tensor.to(getattr(torch, dtype)).contiguous()
        for _, name, tensor in gguf_checkpoint_tensors(gguf_file, config.num_attention_heads,
                                                       config.num_key_value_heads)
        if tensor is not None
    }
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(config, dtype), indent=2))
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": _eos(config)}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    unpacked_tokenizer(gguf_file).save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.gguf_to_hf", description=__doc__.splitlines()[0])
    parser.add_argument("gguf_file", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)
    print(convert(args.gguf_file, args.out_dir, args.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
