"""Hugging Face model directory -> this rank's CausalLM, its weight shards read from safetensors."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.models import CausalLM, model_class_for
from kernels.backend import KernelBackend
from parallel.layers import ShardShapeError
from parallel.state import ParallelContext

logger = logging.getLogger(__name__)

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
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


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
    model_dir: str | Path,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    parallel: ParallelContext,
    backend: KernelBackend,
) -> CausalLM:
    """Build this rank's model (uninitialised) and fill it from every *.safetensors in model_dir."""
    files = safetensors_files(model_dir)
    with torch.device(device):
        model = model_class_for(model_config)(model_config, parallel, backend, dtype=dtype)
    params = dict(model.named_parameters())  # a tied lm_head shares the embedding: not listed
    expected = {ckpt: param for param in params for ckpt in param_to_checkpoint(param)}
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as checkpoint:
            for name in checkpoint.keys():
                if name not in expected:
                    if not _IGNORED.search(name) and not (
                        model_config.tie_word_embeddings and name == "lm_head.weight"
                    ):
                        logger.warning(
                            "ignoring checkpoint tensor %s (%s): the model has no such weight",
                            name,
                            file.name,
                        )
                    continue
                param_name, shard_id = checkpoint_to_param(name)
                param = params[param_name]
                try:
                    param.weight_loader(param, checkpoint.get_slice(name), shard_id)
                except ShardShapeError as e:
                    raise ModelLoadError(f"tensor {name!r} in {file.name}: {e}") from None
                loaded.add(name)
    missing = sorted(set(expected) - loaded)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ModelLoadError(
            f"checkpoint in {str(model_dir)!r} is missing tensor(s) the model needs: {shown}"
        )
    return model.eval()


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
            f"no *.safetensors files in {str(path)!r} (only safetensors checkpoints are supported)"
        )
    return files


def load_tokenizer(model_dir: str | Path):
    """The directory's Hugging Face tokenizer, from local files only."""
    from transformers import AutoTokenizer

    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"tokenizer directory {str(path)!r} does not exist")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {str(path)!r}: {e}") from e
