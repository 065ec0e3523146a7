"""Loading a Hugging Face directory into this rank's model: errors, tied heads, sharded reads."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import engine.checkpoint.loader
from engine.checkpoint.loader import load_model, load_tokenizer
from engine.checkpoint.model_config import load_model_config
from engine.checkpoint.tokenizer_files import pretrained_tokenizer
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from kernels.backend import get_backend
from parallel.layers import QKVParallelLinear, RowParallelLinear
from parallel.state import ParallelContext


def load(model_dir, parallel: ParallelContext | None = None):
    config = load_model_config(model_dir)
    return load_model(
        model_dir, config, torch.float32, "cpu", parallel or ParallelContext(), get_backend("torch")
    )


@pytest.fixture
def llama_copy(tiny_llama_dir, tmp_path):
    """A writable copy of the tiny Llama directory, to damage."""
    return shutil.copytree(tiny_llama_dir, tmp_path / "model")


def rewrite_checkpoint(model_dir, edit) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})


def test_missing_directory_is_a_model_load_error(tmp_path):
    config = ModelConfig(
        architecture="llama",
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=4,
        max_position_embeddings=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model.*does not exist"):
        load_model(missing, config, torch.float32, "cpu", ParallelContext(), get_backend("torch"))


def test_directory_without_safetensors_is_a_model_load_error(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load(llama_copy)


def test_missing_tensor_is_named_in_the_error(llama_copy):
    rewrite_checkpoint(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing.*'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load(llama_copy)


def test_untied_model_without_lm_head_is_a_missing_tensor(llama_copy):
    rewrite_checkpoint(llama_copy, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ModelLoadError, match="'lm_head.weight'"):
        load(llama_copy)


def test_tensor_of_the_wrong_shape_is_named_in_the_error(llama_copy):
    def shrink_k_proj(tensors):
        name = "model.layers.0.self_attn.k_proj.weight"
        tensors[name] = tensors[name][:-1].clone()

    rewrite_checkpoint(llama_copy, shrink_k_proj)
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight'.*shape"):
        load(llama_copy)


def test_rotary_inv_freq_tensors_are_ignored(llama_copy):
    def add_inv_freq(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    rewrite_checkpoint(llama_copy, add_inv_freq)
    model = load(llama_copy)
    assert model.num_layers == 2


def test_tied_checkpoint_shares_the_embedding_with_the_lm_head(tiny_qwen2_dir):
    with safe_open(str(tiny_qwen2_dir / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
        embedding = f.get_tensor("model.embed_tokens.weight")
    model = load(tiny_qwen2_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, embedding)


def test_loaded_weights_equal_the_checkpoint(tiny_llama_dir):
    model = load(tiny_llama_dir)
    checkpoint = load_file(tiny_llama_dir / "model.safetensors")
    attn = model.model.layers[1].self_attn
    q, k, v = attn.qkv_proj.weight.split([attn.qkv_proj.q_size, attn.qkv_proj.kv_size, attn.qkv_proj.kv_size])
    assert torch.equal(q, checkpoint["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(v, checkpoint["model.layers.1.self_attn.v_proj.weight"])
    gate, up = model.model.layers[0].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(up, checkpoint["model.layers.0.mlp.up_proj.weight"])
    norm = model.model.layers[1].post_attention_layernorm.weight
    assert torch.equal(norm, checkpoint["model.layers.1.post_attention_layernorm.weight"])


class RecordingSlice:
    """A safetensors slice that records how it is indexed."""

    def __init__(self, inner, reads: list):
        self.inner = inner
        self.reads = reads

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, key):
        self.reads.append(key)
        return self.inner[key]


def test_weight_loader_reads_only_this_ranks_rows_from_a_safetensors_slice(tiny_llama_dir):
    config = load_model_config(tiny_llama_dir)
    name = "model.layers.0.self_attn.q_proj.weight"
    with safe_open(str(tiny_llama_dir / "model.safetensors"), framework="pt") as f:
        full = f.get_tensor(name)
        reads: list = []
        layer = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            ParallelContext(rank=1, world_size=2),
        )
        layer.weight.weight_loader(layer.weight, RecordingSlice(f.get_slice(name), reads), "q")
    half = full.shape[0] // 2
    assert reads == [slice(half, 2 * half)]
    assert torch.equal(layer.weight[: layer.q_size], full[half:])


def test_row_parallel_weight_loader_reads_only_this_ranks_columns(tiny_llama_dir):
    config = load_model_config(tiny_llama_dir)
    name = "model.layers.0.mlp.down_proj.weight"
    with safe_open(str(tiny_llama_dir / "model.safetensors"), framework="pt") as f:
        full = f.get_tensor(name)
        reads: list = []
        layer = RowParallelLinear(
            config.intermediate_size, config.hidden_size, ParallelContext(rank=0, world_size=4)
        )
        layer.weight.weight_loader(layer.weight, RecordingSlice(f.get_slice(name), reads))
    quarter = config.intermediate_size // 4
    assert reads == [(slice(None), slice(0, quarter))]
    assert torch.equal(layer.weight, full[:, :quarter])


def test_tp2_rank_load_reads_only_its_shard_of_every_sharded_tensor(tiny_llama_dir, monkeypatch):
    reads: dict[str, list] = {}

    class RecordingCheckpoint:
        def __init__(self, *args, **kwargs):
            self.inner = safe_open(*args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return RecordingSlice(self.inner.get_slice(name), reads.setdefault(name, []))

    monkeypatch.setattr(engine.checkpoint.loader, "safe_open", RecordingCheckpoint)
    load(tiny_llama_dir, ParallelContext(rank=1, world_size=2))

    assert reads, "the loader did not read through get_slice"
    replicated = {name for name in reads if "norm" in name}  # norm weights: every rank holds them whole
    for name, keys in reads.items():
        assert keys, f"{name} was never read"
        if name not in replicated:
            assert slice(None) not in keys, f"rank 1 read all of the sharded tensor {name}"


def test_load_tokenizer_from_a_missing_directory_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(tmp_path / "nowhere")


def tokenizer_behaviour(tokenizer) -> tuple:
    """What a served request sees of a tokenizer: its ids, text, special tokens and rendered chat."""
    texts = ["Hello world", "  spaces\tand\nlines ", "émoji 🙂 and 中文", "<|im_start|>user</s>"]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = [tokenizer.encode(text) for text in texts]
    return (type(tokenizer).__name__, ids, [tokenizer.decode(i) for i in ids],
            tokenizer.special_tokens_map, tokenizer.eos_token_id, tokenizer.bos_token_id, len(tokenizer),
            tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize("fixture, shortcut", [("tiny_llama_dir", True), ("tiny_qwen2_dir", False),
                                               ("tiny_qwen3_dir", False), ("smollm2_gguf", True)])
def test_a_tokenizer_is_the_one_autotokenizer_gives_without_autotokenizer_where_it_would_pick_the_generic_class(
        fixture, shortcut, request, monkeypatch):
    # the Qwen models' tokenizer_config.json says TokenizersBackend, and AutoTokenizer gives them Qwen2Tokenizer
    from transformers import AutoTokenizer

    from engine.checkpoint.gguf_cache import unpacked_dir

    path = request.getfixturevalue(fixture)
    if fixture == "smollm2_gguf":  # the GGUF cache's tokenizer folder, written on the first load
        load_tokenizer(path)
        path = unpacked_dir(path) / "tokenizer"
    expected = tokenizer_behaviour(AutoTokenizer.from_pretrained(str(path), local_files_only=True))
    calls = []
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    assert tokenizer_behaviour(pretrained_tokenizer(path)) == expected
    assert calls == ([] if shortcut else [(str(path),)])
