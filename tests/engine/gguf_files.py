"""Test-side GGUF writing: a tiny Hugging Face directory converted as llama.cpp's converter does it.

Written independently of engine/checkpoint/gguf.py (which only reads), so a mapping mistake in either shows up
as a mismatch against transformers on the original directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
HF_TO_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute` for Llama q/k: each head's two rotary halves interleaved."""
    rows = weights.shape[0]
    return weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape
    )


def gguf_name(hf_name: str) -> str:
    *module, kind = hf_name.split(".")
    module = ".".join(module)
    if module in HF_TO_GGUF_GLOBAL:
        return f"{HF_TO_GGUF_GLOBAL[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)  # model.layers.N.rest
    return f"blk.{layer}.{HF_TO_GGUF_LAYER[rest]}.{kind}"


def write_gguf(
    model_dir: Path,
    out: Path,
    quant: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    rope_freqs: np.ndarray | None = None,
) -> Path:
    """Convert a make_model directory (llama, qwen2 or qwen3) to one GGUF file: 2-D weights in `quant`,
    norms and biases in F32, the tokenizer and chat template in the metadata."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(config.get("rope_theta", rope.get("rope_theta", 10000.0)))
    writer.add_vocab_size(config["vocab_size"])
    _add_tokenizer(writer, model_dir)

    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        array = tensor.to(torch.float32).numpy()
        if arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, heads)
        elif arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, kv_heads)
        if array.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, quant), raw_dtype=quant)
        else:
            writer.add_tensor(gguf_name(name), array)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer(writer: gguf.GGUFWriter, model_dir: Path) -> None:
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = {added["id"] for added in spec["added_tokens"] if added["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL for i in range(len(tokens))]
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[config.get("bos_token") or "<s>"])
    writer.add_eos_token_id(vocab[config.get("eos_token") or "</s>"])
    writer.add_add_bos_token(False)
    template = model_dir / "chat_template.jinja"
    writer.add_chat_template(template.read_text() if template.is_file() else config["chat_template"])
