"""GGUF checkpoints: dequantization of each supported type, llama.cpp's q/k order, the config and
tokenizer from metadata, clear errors, and greedy output equal to transformers on the original weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.checkpoint.gguf import SUPPORTED_TYPES, find_gguf_file, gguf_checkpoint_tensors, unpermute_qk
from engine.checkpoint.loader import load_tokenizer
from engine.checkpoint.model_config import load_model_config
from engine.config import EngineConfig, ModelConfig
from engine.errors import ModelLoadError
from tests.engine.gguf_files import llama_cpp_permute, write_gguf
from tests.engine.test_hf_equivalence import assert_diverse, random_prompts

Q = gguf.GGMLQuantizationType
ROWS, COLS = 6, 512  # two 256-wide super-blocks per row for the K-quants


@pytest.fixture(autouse=True)
def gguf_cache_root(tmp_path, monkeypatch) -> Path:
    """Each test unpacks its GGUF files (engine/checkpoint/gguf_cache.py) in its own cache folder, not yours."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SHARDSERVE_CACHE", str(root))
    return root


def one_tensor_gguf(path: Path, name: str, raw: np.ndarray, qtype: Q, arch: str = "llama") -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def encoded(weights: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """`weights` in `qtype`; the K-quants, which the gguf package cannot encode, get random blocks
    (bytes below 0x78, so every float16 scale in them is finite)."""
    try:
        return gguf.quants.quantize(weights, qtype)
    except NotImplementedError:
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        return rng.integers(0, 0x78, size=(ROWS, COLS // block * block_bytes), dtype=np.uint8)


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_each_supported_type_dequantizes_as_the_gguf_package_does(type_name, tmp_path):
    qtype = Q[type_name]
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((ROWS, COLS)).astype(np.float32)  # [out_features, in_features]
    raw = encoded(weights, qtype, rng)
    file = one_tensor_gguf(tmp_path / "w.gguf", "blk.0.ffn_up.weight", raw, qtype)

    [(gguf_name, hf_name, tensor)] = list(gguf_checkpoint_tensors(file, num_attention_heads=1, num_key_value_heads=1))

    assert (gguf_name, hf_name) == ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight")
    assert tensor.shape == (ROWS, COLS) and tensor.dtype == torch.float32
    reference = gguf.quants.dequantize(raw, qtype).reshape(ROWS, COLS)
    np.testing.assert_array_equal(tensor.numpy(), reference)
    assert np.isfinite(reference).all() and np.abs(reference).max() > 0
    if not type_name.endswith("_K"):  # encoded from `weights`: within its quantization error
        bits = {"F32": 32, "F16": 11, "BF16": 8, "Q8_0": 8, "Q5_0": 5, "Q5_1": 5, "Q4_0": 4, "Q4_1": 4}[type_name]
        assert np.abs(tensor.numpy() - weights).max() <= 2.0 * np.abs(weights).max() * 2.0 ** (1 - bits)


def test_llama_q_and_k_rows_return_to_hugging_face_order():
    weights = torch.randn(4 * 8, 5)  # 4 heads of head_dim 8
    permuted = torch.from_numpy(llama_cpp_permute(weights.numpy(), 4))
    assert not torch.equal(permuted, weights)
    assert torch.equal(unpermute_qk(permuted, 4), weights)


def test_the_config_comes_from_metadata(tiny_llama_dir, tmp_path):
    file = write_gguf(tiny_llama_dir, tmp_path / "tiny.gguf")
    from_gguf, from_hf = load_model_config(file), load_model_config(tiny_llama_dir)
    assert from_gguf.checkpoint_format == "gguf" and from_gguf.torch_dtype is None
    same = ModelConfig.model_fields.keys() - {"checkpoint_format", "torch_dtype", "rms_norm_eps"}
    assert {k: getattr(from_gguf, k) for k in same} == {k: getattr(from_hf, k) for k in same}
    assert math.isclose(from_gguf.rms_norm_eps, from_hf.rms_norm_eps, rel_tol=1e-6)  # GGUF stores float32
    assert load_model_config(tmp_path) == from_gguf  # a directory holding one .gguf


def test_the_tokenizer_and_chat_template_come_from_metadata(tiny_llama_dir, tmp_path):
    file = write_gguf(tiny_llama_dir, tmp_path / "tiny.gguf")
    ours, original = load_tokenizer(file), load_tokenizer(tiny_llama_dir)
    text = "def main():\n    return 42  # héllo → 日本"
    assert ours.encode(text) == original.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        original.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert (ours.bos_token_id, ours.eos_token_id) == (original.bos_token_id, original.eos_token_id)
    assert load_tokenizer(file).encode(text) == ours.encode(text)  # again, from the converted copy


@pytest.mark.parametrize("preferred", [True, False])
def test_auto_dtype_of_a_gguf_model_is_bfloat16_where_the_cpu_multiplies_it(preferred, tiny_llama_dir, tmp_path,
                                                                             monkeypatch):
    monkeypatch.setattr("kernels.backend.cpu_supports_bf16", lambda: preferred)
    config = load_model_config(write_gguf(tiny_llama_dir, tmp_path / "tiny.gguf"))
    expected = torch.bfloat16 if preferred else torch.float32
    assert EngineConfig(model="x", device="cpu").torch_dtype(config) == expected
    assert EngineConfig(model="x", device="cpu", dtype="float32").torch_dtype(config) == torch.float32


def llama3_rope_freqs(model_dir: Path) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores for Llama 3 rope scaling, from transformers'."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(model_dir)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    head_dim = config.hidden_size // config.num_attention_heads
    base = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return (base / scaled).numpy()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_llama3_rope_dir"])
def test_greedy_output_from_the_gguf_equals_transformers_on_the_original(fixture, request, hf_greedy, tmp_path):
    model_dir = request.getfixturevalue(fixture)
    freqs = llama3_rope_freqs(model_dir) if fixture == "tiny_llama3_rope_dir" else None
    file = write_gguf(model_dir, tmp_path / "model.gguf", rope_freqs=freqs)
    prompts = random_prompts([3, 17, 40, 90], seed=7)
    expected = hf_greedy(model_dir, prompts, 12, ignore_eos=True)
    assert_diverse(expected)
    llm = LLM(model=str(file), dtype="float32", max_num_batched_tokens=32)  # prompts prefill in chunks
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_q8_0_model_runs_in_bfloat16_close_to_the_original(tiny_llama_dir, hf_greedy, tmp_path):
    file = write_gguf(tiny_llama_dir, tmp_path / "q8.gguf", quant=Q.Q8_0)
    [prompt] = random_prompts([20], seed=3)
    [expected] = hf_greedy(tiny_llama_dir, [prompt], 8, ignore_eos=True)
    llm = LLM(model=str(file), dtype="bfloat16")
    [output] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert output.outputs[0].token_ids[:2] == expected[:2]  # 8-bit weights, bf16 math: the start agrees


def test_an_unsupported_architecture_is_named(tmp_path):
    file = one_tensor_gguf(tmp_path / "g.gguf", "token_embd.weight", np.zeros((4, 32), np.float32), Q.F32, "gemma")
    with pytest.raises(ModelLoadError, match="architecture 'gemma'.*supported: llama, qwen2, qwen3"):
        load_model_config(file)


def test_an_unsupported_quantization_type_is_named(tmp_path):
    block, block_bytes = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
    raw = np.zeros((2, 64 // block * block_bytes), np.uint8)
    file = one_tensor_gguf(tmp_path / "g.gguf", "blk.0.ffn_up.weight", raw, Q.IQ4_NL)
    with pytest.raises(ModelLoadError, match="'blk.0.ffn_up.weight'.*IQ4_NL, which is not supported"):
        list(gguf_checkpoint_tensors(file, 1, 1))


def test_model_paths_name_one_gguf_file(tmp_path):
    assert find_gguf_file(tmp_path) is None  # nothing there: not a GGUF model
    (tmp_path / "a.gguf").write_bytes(b"")
    assert find_gguf_file(tmp_path) == tmp_path / "a.gguf"
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="several GGUF files"):
        find_gguf_file(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert find_gguf_file(tmp_path) is None  # a Hugging Face directory wins
    with pytest.raises(ModelLoadError, match="cannot read .* as a GGUF file"):
        load_model_config(tmp_path / "a.gguf")


def test_gguf_to_hf_writes_what_transformers_reads_back_as_the_original(tiny_qwen3_dir, hf_greedy, tmp_path):
    """scripts/gguf_to_hf.py: the benchmarks' way to hand a GGUF model's weights to a peer that reads only
    Hugging Face directories."""
    from scripts.gguf_to_hf import convert

    out = convert(write_gguf(tiny_qwen3_dir, tmp_path / "q3.gguf"), tmp_path / "hf", dtype="float32")
    prompts = random_prompts([5, 30], seed=11)
    assert hf_greedy(out, prompts, 10, ignore_eos=True) == hf_greedy(tiny_qwen3_dir, prompts, 10, ignore_eos=True)
    assert load_tokenizer(out).encode("héllo wörld") == load_tokenizer(tiny_qwen3_dir).encode("héllo wörld")


@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16"])
@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_dtype_of_a_16_bit_checkpoint_on_cpu_is_the_faster_one_that_fits(checkpoint, native_bf16, tiny_llama_dir,
                                                                              monkeypatch):
    """bfloat16 where the CPU multiplies it; float32 where it emulates it (AVX2), unless float32 weights would
    take more than half the free memory; a float32 checkpoint and an explicit dtype are kept."""
    monkeypatch.setattr("kernels.backend.cpu_supports_bf16", lambda: native_bf16)
    config = load_model_config(tiny_llama_dir).model_copy(update={"torch_dtype": checkpoint})
    cpu = EngineConfig(model="x", device="cpu")
    monkeypatch.setattr("engine.config.available_memory_bytes", lambda: 8 * config.num_parameters * 4)
    assert cpu.torch_dtype(config) == (torch.bfloat16 if native_bf16 else torch.float32)
    monkeypatch.setattr("engine.config.available_memory_bytes", lambda: config.num_parameters * 4)
    assert cpu.torch_dtype(config) == torch.bfloat16  # float32 would not fit in half of what is free
    assert EngineConfig(model="x", device="cpu", dtype=checkpoint).torch_dtype(config) == getattr(torch, checkpoint)
    as_float32 = config.model_copy(update={"torch_dtype": "float32"})
    assert cpu.torch_dtype(as_float32) == torch.float32


def test_num_parameters_counts_the_matrices_transformers_loads(tiny_llama_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    matrices = sum(p.numel() for p in hf.parameters() if p.dim() == 2)  # a tied head is one parameter
    assert load_model_config(tiny_llama_dir).num_parameters == matrices
