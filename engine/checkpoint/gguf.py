"""GGUF checkpoints (llama.cpp's single-file format), read with the `gguf` package.

One file holds the config (metadata keys `{arch}.*`), the tokenizer and chat template
(`tokenizer.*`) and the weights, often block-quantized. Here the weights are dequantized at load,
tensor by tensor, to float32 and then to the engine's dtype: the forward pass is the same as for
a safetensors checkpoint. Tensor names are mapped to Hugging Face's (`blk.0.attn_q.weight` ->
`model.layers.0.self_attn.q_proj.weight`) so engine/checkpoint/loader.py and the TP weight loaders see one
naming. llama.cpp's converter permutes Llama's q/k rows for its interleaved rotary; that is undone
here, since the engine rotates halves (as Hugging Face does).

This module reads the file every time; engine/checkpoint/gguf_cache.py keeps what it reads on disk, so that
only a file's first load pays for the parse and the dequantization.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from engine.errors import ModelLoadError

# general.architecture -> ModelConfig.architecture
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Architectures whose q/k rows llama.cpp's converter permuted (interleaved rotary): Qwen uses NeoX rotary.
_PERMUTED_QK = {"llama"}
# Weight encodings we dequantize (each checked against gguf.quants.dequantize in tests).
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)")


def find_gguf_file(path: str | Path) -> Path | None:
    """The GGUF file that `--model path` names: the file itself, or the one *.gguf in a directory
    without a config.json. None for a Hugging Face directory."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix == ".gguf" else None
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    files = sorted(p.glob("*.gguf"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise ModelLoadError(f"{str(p)!r} holds several GGUF files ({names}): pass one of them as the model")
    return files[0] if files else None


def open_gguf(file: str | Path):
    """A gguf.GGUFReader over the file (memory-mapped: tensors are read when dequantized). Parsing the
    metadata takes seconds for a large vocabulary, so a process keeps its last readers."""
    stat = Path(file).stat()
    return _open_gguf(str(Path(file).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_gguf(file: str, size: int, mtime_ns: int):
    import gguf

    try:
        return gguf.GGUFReader(file)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"cannot read {file!r} as a GGUF file: {e}") from e


def metadata(reader) -> dict:
    """Every metadata key with a scalar, string or list value; the token tables are left out."""
    out = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.scores"):
            continue
        out[key] = field.contents()
    return out


def model_config_fields(file: str | Path) -> dict:
    """ModelConfig's fields from a GGUF file's metadata and tensor list."""
    reader = open_gguf(file)
    meta = metadata(reader)
    gguf_arch = meta.get("general.architecture")
    if gguf_arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {gguf_arch!r} in {Path(file).name} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    _check_tensor_types(reader, file)

    def get(key: str, default=None):
        value = meta.get(f"{gguf_arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata key {gguf_arch}.{key} is missing in {Path(file).name}")
        if isinstance(value, list):
            raise ModelLoadError(
                f"GGUF metadata {gguf_arch}.{key} varies per layer in {Path(file).name}: not supported"
            )
        return value

    tensors = {t.name: t for t in reader.tensors}
    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    vocab = meta.get(f"{gguf_arch}.vocab_size")
    if vocab is None:
        vocab = int(tensors["token_embd.weight"].shape[-1])
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    return dict(
        architecture=ARCHITECTURES[gguf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(get("attention.key_length", hidden // num_heads)),
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, gguf_arch, tensors, file),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
        torch_dtype=None,
        checkpoint_format="gguf",
    )


def _rope_scaling(meta: dict, arch: str, tensors: dict, file) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in tensors:
        # Llama 3.1-style scaling: the converter stores the per-frequency divisors, not their recipe.
        factors = _dequantize(tensors["rope_freqs.weight"]).reshape(-1)
        return {"rope_type": "freq_factors", "factors": [float(f) for f in factors]}
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    raise ModelLoadError(f"GGUF rope scaling {kind!r} in {Path(file).name} is not supported (supported: linear)")


def _check_tensor_types(reader, file) -> None:
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"tensor {tensor.name!r} in {Path(file).name} is quantized as {tensor.tensor_type.name}, "
                f"which is not supported (supported: {', '.join(SUPPORTED_TYPES)})"
            )


def hf_tensor_name(gguf_name: str) -> str | None:
    """`blk.3.ffn_up.weight` -> `model.layers.3.mlp.up_proj.weight`; None for a tensor we do not use."""
    if m := _LAYER_TENSOR.fullmatch(gguf_name):
        layer, module, kind = m.groups()
        if module in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[module]}.{kind}"
        return None
    if (m := _GLOBAL_TENSOR.fullmatch(gguf_name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def gguf_checkpoint_tensors(
    file: str | Path, num_attention_heads: int, num_key_value_heads: int
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(GGUF name, Hugging Face name, float32 tensor in Hugging Face's layout) per tensor; a tensor with
    no Hugging Face counterpart keeps its GGUF name and is not read."""
    reader = open_gguf(file)
    gguf_arch = reader.fields["general.architecture"].contents()
    _check_tensor_types(reader, file)
    for tensor in reader.tensors:
        hf_name = hf_tensor_name(tensor.name)
        if hf_name is None:  # e.g. rope_freqs, which the config already holds
            yield tensor.name, tensor.name, None
            continue
        weights = torch.from_numpy(_dequantize(tensor))  # [rows, cols] = [out_features, in_features]
        if gguf_arch in _PERMUTED_QK:
            if ".q_proj." in hf_name:
                weights = unpermute_qk(weights, num_attention_heads)
            elif ".k_proj." in hf_name:
                weights = unpermute_qk(weights, num_key_value_heads)
        yield tensor.name, hf_name, weights


def _dequantize(tensor) -> np.ndarray:
    """float32 array in numpy order: GGUF lists dimensions fastest first, so [in, out] reads [out, in]."""
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)


def unpermute_qk(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head it interleaves the two rotary halves
    (rows 0, half, 1, half+1, ...); Hugging Face keeps the halves apart."""
    rows = weights.shape[0]
    rest = weights.shape[1:]
    head_dim = rows // num_heads
    return (
        weights.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()
    )


def build_gguf_tokenizer(file: str | Path):
    """The file's tokenizer (vocabulary, merges, special tokens, chat template), converted by
    transformers' GGUF reader: seconds, so engine/checkpoint/gguf_cache.py keeps the result."""
    from transformers import AutoTokenizer

    path = Path(file)
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot build a tokenizer from the GGUF metadata of {str(path)!r}: {e}") from e
