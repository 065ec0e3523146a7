"""The random-weight models (make-model): loadable by transformers and by us, a working tokenizer, diverse output."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from engine.checkpoint.loader import load_model, load_tokenizer
from engine.checkpoint.model_config import load_model_config
from engine.checkpoint.random_model import default_bench_model_dir, ensure_bench_model, main, make_model
from kernels.backend import get_backend
from parallel.state import ParallelContext

TEXTS = ["héllo → 日本", "def main():\n    return 42\n", "  two  spaces, tabs\tand emoji 🚀"]
PROMPTS = ["def main():", "import os\n", "The quick brown fox", "héllo → 日本"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_model_loads_in_transformers_and_in_our_loader(arch, request, hf_greedy):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    hf = hf_greedy.model(model_dir)
    assert hf.config.model_type == arch
    config = load_model_config(model_dir)
    ours = load_model(model_dir, config, torch.float32, "cpu", ParallelContext(), get_backend("torch"))
    hf_embedding = hf.get_input_embeddings().weight
    assert torch.equal(ours.model.embed_tokens.weight, hf_embedding)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert len(load_tokenizer(model_dir)) == config.vocab_size


def test_tiny_presets_are_gqa_and_qwen2_has_bias_and_tied_embeddings(tiny_llama_dir, tiny_qwen2_dir):
    llama, qwen2 = load_model_config(tiny_llama_dir), load_model_config(tiny_qwen2_dir)
    assert (llama.num_attention_heads, llama.num_key_value_heads) == (4, 2)
    assert not llama.tie_word_embeddings and not llama.attention_bias
    assert qwen2.attention_bias and qwen2.tie_word_embeddings
    assert json.loads((tiny_llama_dir / "config.json").read_text())["initializer_range"] == 0.1
    biases = [
        t for name, t in load_file(tiny_qwen2_dir / "model.safetensors").items() if name.endswith(".bias")
    ]
    assert biases and all(b.abs().sum() > 0 for b in biases)  # random, not transformers' zeros


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_text_including_multibyte_utf8(arch, text, request):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # BPE merges happened: not one token per byte
    # transformers' tokenizer class (Qwen2Tokenizer for qwen2 and qwen3) splits text as the trained file does
    assert ids == Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids


def test_tiny_qwen3_has_random_qk_norms_an_explicit_head_dim_and_no_bias(tiny_qwen3_dir):
    config = load_model_config(tiny_qwen3_dir)
    assert config.architecture == "qwen3" and config.tie_word_embeddings and not config.attention_bias
    assert (config.hidden_size, config.num_attention_heads, config.head_dim) == (256, 4, 128)
    tensors = load_file(tiny_qwen3_dir / "model.safetensors")
    assert not any(name.endswith(".bias") for name in tensors) and "lm_head.weight" not in tensors
    qk_norms = [t for name, t in tensors.items() if name.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(qk_norms) == 2 * config.num_hidden_layers
    assert all(t.shape == (128,) and not torch.all(t == 1) for t in qk_norms)  # random, not transformers' ones


def test_special_tokens_are_unk_0_bos_1_eos_2(tiny_llama_dir):
    tokenizer = load_tokenizer(tiny_llama_dir)
    assert tokenizer.convert_tokens_to_ids(["<unk>", "<s>", "</s>"]) == [0, 1, 2]
    assert (tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.decode([1, 2], skip_special_tokens=True) == ""


def test_chat_template_renders_turns_and_the_generation_prompt(tiny_llama_dir):
    tokenizer = load_tokenizer(tiny_llama_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<s>system\nBe brief.</s>\n<s>user\nhi</s>\n<s>assistant\n"
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without_prompt == "<s>system\nBe brief.</s>\n<s>user\nhi</s>\n"
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert ids.count(1) == 3 and ids.count(2) == 2  # <s> and </s> are single special tokens


def test_greedy_output_of_the_tiny_model_is_diverse(tiny_llama_dir, hf_greedy):
    tokenizer = load_tokenizer(tiny_llama_dir)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    outputs = hf_greedy(tiny_llama_dir, prompts, 24, ignore_eos=True)
    # 24 distinct tokens for a plain prompt; no prompt falls into a loop (a few repeats among 24
    # draws from 1024 tokens happen by chance, as in any random sequence).
    assert len(set(outputs[2])) == 24
    assert all(len(out) == 24 and len(set(out)) >= 20 for out in outputs)
    assert len({tuple(out) for out in outputs}) == len(PROMPTS)


def test_make_model_is_deterministic_for_a_seed(tiny_llama_dir, tmp_path):
    again = make_model("llama", "tiny", tmp_path / "again", seed=0)
    other_seed = make_model("llama", "tiny", tmp_path / "seed1", seed=1)
    first, second = load_file(tiny_llama_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert (again / "tokenizer.json").read_bytes() == (tiny_llama_dir / "tokenizer.json").read_bytes()
    third = load_file(other_seed / "model.safetensors")
    assert not torch.equal(first["model.embed_tokens.weight"], third["model.embed_tokens.weight"])


def test_cli_writes_the_requested_model(tmp_path, capsys):
    out = main(["--arch", "qwen2", "--preset", "tiny", "--out", str(tmp_path / "cli"), "--seed", "3"])
    assert out == tmp_path / "cli" and capsys.readouterr().out.strip() == str(out)
    assert load_model_config(out).architecture == "qwen2"


def test_ensure_bench_model_builds_once_under_the_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDSERVE_CACHE", str(tmp_path / "cache"))
    assert default_bench_model_dir() == tmp_path / "cache" / "bench-llama"
    target = tmp_path / "cache" / "demo-tiny"
    built = ensure_bench_model(target, preset="tiny")
    assert built == target and (built / "model.safetensors").is_file()
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert ensure_bench_model(target, preset="tiny") == target
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert [p.name for p in target.parent.iterdir()] == ["demo-tiny"]  # no staging leftovers
