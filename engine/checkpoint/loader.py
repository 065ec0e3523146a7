"""A checkpoint (Hugging Face safetensors directory or GGUF file) -> this rank's CausalLM and tokenizer."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.checkpoint.gguf import find_gguf_file
from engine.checkpoint.gguf_cache import unpacked_tensors, unpacked_tokenizer
from engine.checkpoint.tokenizer_files import pretrained_tokenizer
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.models import CausalLM, model_class_for
from kernels.backend import KernelBackend
from parallel.layers import CheckpointTensor, ShardShapeError
from parallel.state import ParallelContext

logger = logging.getLogger("shardserve.loader")

# Checkpoint module name -> (our fused module name, shard_id). Everything else maps to itself.
FUSED_MODULES: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_FUSED_PARTS = {
    fused: [part for part, (f, _) in FUSED_MODULES.items() if f == fused]
    for fused in {f for f, _ in FUSED_MODULES.values()}
}
# Not weights: rotary tables (GGUF's rope_freqs is read into ModelConfig.rope_scaling).
_IGNORED = re.compile(r"rotary_emb\.inv_freq$|^rope_freqs\.weight$")


def checkpoint_to_param(name: str) -> tuple[str, str | int | None]:
    """`model.layers.0.self_attn.k_proj.weight` -> (`model.layers.0.self_attn.qkv_proj.weight`, "k")."""
    *prefix, module, kind = name.split(".")
    if module in FUSED_MODULES:
        fused, shard_id = FUSED_MODULES[module]
        return ".".join([*prefix, fused, kind]), shard_id
    return name, None


def param_to_checkpoint(param_name: str) -> list[str]:
    """The checkpoint tensors a parameter is assembled from (inverse of checkpoint_to_param)."""
    *prefix, module, kind = param_name.split(".")
    parts = _FUSED_PARTS.get(module, [module])
    return [".".join([*prefix, part, kind]) for part in parts]


def load_model(
    model_path: str | Path,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    parallel: ParallelContext,
    backend: KernelBackend,
) -> CausalLM:
    """Build this rank's model (uninitialised) and fill it from the checkpoint: every *.safetensors in a
    Hugging Face directory, or a GGUF file (dequantized)."""
    with torch.device(device):
        model = model_class_for(model_config)(model_config, parallel, backend, dtype=dtype)
    params = dict(model.named_parameters())  # a tied lm_head shares the embedding: not listed
    expected = {ckpt: param for param in params for ckpt in param_to_checkpoint(param)}
    loaded: set[str] = set()
    for source, name, tensor in checkpoint_tensors(model_path, model_config, dtype):
        if name not in expected:
            if not _IGNORED.search(name) and not (
                model_config.tie_word_embeddings and name == "lm_head.weight"
            ):
                logger.warning("ignoring checkpoint tensor %s: the model has no such weight", source)
            continue
        param_name, shard_id = checkpoint_to_param(name)
        param = params[param_name]
        try:
            param.weight_loader(param, tensor, shard_id)
        except ShardShapeError as e:
            raise ModelLoadError(f"tensor {source}: {e}") from None
        loaded.add(name)
    missing = sorted(set(expected) - loaded)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ModelLoadError(
            f"checkpoint in {str(model_path)!r} is missing tensor(s) the model needs: {shown}"
        )
    return model.eval()


def checkpoint_tensors(
    model_path: str | Path, model_config: ModelConfig, dtype: torch.dtype
) -> Iterator[tuple[str, str, CheckpointTensor]]:
    """(where it came from, Hugging Face name, tensor or safetensors slice) for every checkpoint tensor.
    A GGUF file's come from its weights unpacked in `dtype`, the serving dtype
    (engine/checkpoint/gguf_cache.py), or dequantized from the file on its first load."""
    if (gguf_file := find_gguf_file(model_path)) is not None:
        yield from unpacked_tensors(
            gguf_file, model_config.num_attention_heads, model_config.num_key_value_heads, dtype
        )
        return
    for file in safetensors_files(model_path):
        with safe_open(str(file), framework="pt", device="cpu") as checkpoint:
            for name in checkpoint.keys():
                yield f"{name!r} in {file.name}", name, checkpoint.get_slice(name)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint files of a model directory, in name order."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(
            f"model directory {str(path)!r} does not exist (models load from a local directory)"
        )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors files in {str(path)!r} (checkpoints are safetensors directories or GGUF files)"
        )
    return files


def load_tokenizer(model_dir: str | Path):
    """The directory's Hugging Face tokenizer, or the one a GGUF file describes; local files only."""
    if (gguf_file := find_gguf_file(model_dir)) is not None:
        return unpacked_tokenizer(gguf_file)
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"tokenizer directory {str(path)!r} does not exist")
    try:
        return pretrained_tokenizer(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {str(path)!r}: {e}") from e
