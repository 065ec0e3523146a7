"""The unpacked-GGUF cache (engine/checkpoint/gguf_cache.py): a second load of a GGUF file gives exactly
what the first gave (config, tokenizer, every parameter, greedy tokens) without reading the file; a damaged,
partial or stale cache falls back to the file and is rewritten; a changed file is a new cache entry."""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
import torch

import engine.checkpoint.gguf
import engine.checkpoint.gguf_cache
from engine import LLM, SamplingParams
from engine.checkpoint.gguf import model_config_fields
from engine.checkpoint.gguf_cache import unpack_gguf, unpacked_dir
from engine.checkpoint.loader import checkpoint_tensors, load_model, load_tokenizer
from engine.checkpoint.model_config import load_model_config
from engine.config import ModelConfig
from kernels.backend import get_backend
from parallel.state import ParallelContext
from tests.engine.gguf_files import write_gguf
from tests.engine.test_gguf import llama3_rope_freqs
from tests.engine.test_hf_equivalence import assert_diverse, random_prompts

Q = gguf.GGMLQuantizationType
DTYPES = [torch.bfloat16, torch.float32]
GIB = engine.checkpoint.gguf_cache.SHARD_BYTES


@pytest.fixture(autouse=True)
def gguf_cache_root(tmp_path, monkeypatch) -> Path:
    """Each test unpacks into its own cache folder, not the user's."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SHARDSERVE_CACHE", str(root))
    return root


@pytest.fixture
def q4_file(tiny_llama_dir, tmp_path) -> Path:
    """The tiny Llama as a Q4_1 GGUF file, like the demo model (q/k permuted, untied head)."""
    return write_gguf(tiny_llama_dir, tmp_path / "tiny.Q4_1.gguf", quant=Q.Q4_1)


def load(file: Path, dtype: torch.dtype, parallel: ParallelContext | None = None) -> dict[str, torch.Tensor]:
    """Every parameter of one rank's model loaded from the file (through the cache when it is there)."""
    config = load_model_config(file)
    model = load_model(file, config, dtype, "cpu", parallel or ParallelContext(), get_backend("torch"))
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def sources(file: Path, dtype: torch.dtype) -> list[str]:
    return [source for source, _, _ in checkpoint_tensors(file, load_model_config(file), dtype)]


def read_from_cache(file: Path, dtype: torch.dtype) -> bool:
    return all("unpacked in" in source for source in sources(file, dtype))


def assert_same_parameters(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name], tensor), f"{name} differs"


def forbid_reading_the_gguf(monkeypatch) -> None:
    """Make every way of reading the file itself fail: its parser, the dequantizer and transformers'
    tokenizer converter."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the GGUF file was read")

    engine.checkpoint.gguf._open_gguf.cache_clear()  # a reader this process kept would bypass the patch
    monkeypatch.setattr(gguf, "GGUFReader", forbidden)
    monkeypatch.setattr(gguf.quants, "dequantize", forbidden)
    monkeypatch.setattr(engine.checkpoint.gguf_cache, "build_gguf_tokenizer", forbidden)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shard_bytes", [GIB, 1 << 20], ids=["one-shard", "1MiB-shards"])
def test_cached_weights_equal_the_dequantized_ones_parameter_for_parameter(dtype, shard_bytes, q4_file, monkeypatch):
    monkeypatch.setattr(engine.checkpoint.gguf_cache, "SHARD_BYTES", shard_bytes)
    weights = unpacked_dir(q4_file) / f"weights-{engine.checkpoint.gguf_cache.dtype_name(dtype)}"
    dequantized = load(q4_file, dtype)  # the first load: from the file, writing the cache as it goes
    assert weights.is_dir()

    cached = load(q4_file, dtype)

    assert read_from_cache(q4_file, dtype)
    assert_same_parameters(cached, dequantized)
    num_shards = len(list(weights.glob("*.safetensors")))
    assert num_shards == 1 if shard_bytes == GIB else num_shards > 2


def test_cold_load_equals_a_load_that_never_caches(q4_file, monkeypatch):
    """The first load, which writes the cache as it goes, gives what a load with no cache at all gives."""
    writer = engine.checkpoint.gguf_cache._WeightsWriter
    monkeypatch.setattr(writer, "start", classmethod(lambda cls, *args, **kw: None))
    never_cached = load(q4_file, torch.bfloat16)
    assert not (unpacked_dir(q4_file) / "weights-bfloat16").exists()
    monkeypatch.undo()
    monkeypatch.setenv("SHARDSERVE_CACHE", str(q4_file.parent / "other-cache"))
    assert_same_parameters(load(q4_file, torch.bfloat16), never_cached)
    assert_same_parameters(load(q4_file, torch.bfloat16), never_cached)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_tensor_parallel_rank_reads_its_shard_of_the_cached_weights(dtype, q4_file):
    rank1 = ParallelContext(rank=1, world_size=2)
    dequantized = load(q4_file, dtype, rank1)
    checkpoint = list(checkpoint_tensors(q4_file, load_model_config(q4_file), dtype))
    assert all(hasattr(tensor, "get_shape") for _, _, tensor in checkpoint)  # safetensors slices: read by rows
    assert_same_parameters(load(q4_file, dtype, rank1), dequantized)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama3_rope_dir"])
def test_the_cached_config_is_the_one_read_from_the_metadata(fixture, request, tmp_path):
    model_dir = request.getfixturevalue(fixture)
    freqs = llama3_rope_freqs(model_dir) if fixture == "tiny_llama3_rope_dir" else None
    file = write_gguf(model_dir, tmp_path / "model.gguf", rope_freqs=freqs)
    from_metadata = ModelConfig(**model_config_fields(file))

    assert load_model_config(file) == from_metadata  # cold: parsed, then cached
    assert (unpacked_dir(file) / "model_config.json").is_file()
    assert load_model_config(file) == from_metadata  # warm: from the JSON


def test_a_tensor_the_engine_does_not_load_is_listed_in_the_index_but_not_stored(tiny_llama3_rope_dir, tmp_path):
    file = write_gguf(tiny_llama3_rope_dir, tmp_path / "rope.gguf", rope_freqs=llama3_rope_freqs(tiny_llama3_rope_dir))
    dequantized = load(file, torch.float32)
    cached = list(checkpoint_tensors(file, load_model_config(file), torch.float32))

    [(source, tensor)] = [(source, tensor) for source, name, tensor in cached if name == "rope_freqs.weight"]
    assert tensor is None and "unpacked in" in source  # rope scaling is in the config already
    assert_same_parameters(load(file, torch.float32), dequantized)


def test_the_cached_tokenizer_encodes_and_templates_as_the_converted_one(q4_file):
    converted = engine.checkpoint.gguf.build_gguf_tokenizer(q4_file)
    load_tokenizer(q4_file)  # cold: converted, then cached
    cached = load_tokenizer(q4_file)

    text = "def main():\n    return 42  # héllo → 日本 <|im_end|>"
    assert cached.encode(text) == converted.encode(text)
    assert cached.decode(converted.encode(text)) == converted.decode(converted.encode(text))
    messages = [{"role": "user", "content": "Hi"}]
    assert cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        converted.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert (cached.bos_token_id, cached.eos_token_id, len(cached)) == (
        converted.bos_token_id, converted.eos_token_id, len(converted)
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_second_load_reads_nothing_from_the_gguf_file(dtype, q4_file, monkeypatch):
    config, tokenizer, params = load_model_config(q4_file), load_tokenizer(q4_file), load(q4_file, dtype)
    forbid_reading_the_gguf(monkeypatch)

    assert load_model_config(q4_file) == config
    assert load_tokenizer(q4_file).encode("héllo wörld") == tokenizer.encode("héllo wörld")
    assert_same_parameters(load(q4_file, dtype), params)


def test_a_load_in_another_dtype_unpacks_that_dtype_beside_the_first(q4_file):
    bf16 = load(q4_file, torch.bfloat16)
    fp32 = load(q4_file, torch.float32)
    assert read_from_cache(q4_file, torch.bfloat16) and read_from_cache(q4_file, torch.float32)
    assert_same_parameters(load(q4_file, torch.float32), fp32)
    assert_same_parameters(load(q4_file, torch.bfloat16), bf16)


def truncate_a_shard(weights: Path) -> None:
    shard = next(weights.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def edit_index(weights: Path, edit) -> None:
    index = json.loads((weights / "index.json").read_text())
    edit(index)
    (weights / "index.json").write_text(json.dumps(index))


DAMAGE = {
    "truncated-shard": truncate_a_shard,
    "missing-shard": lambda weights: next(weights.glob("*.safetensors")).unlink(),
    "missing-index": lambda weights: (weights / "index.json").unlink(),
    "garbled-index": lambda weights: (weights / "index.json").write_text('{"version": 1, "tens'),
    "older-format": lambda weights: edit_index(weights, lambda index: index.update(version=0)),
    "other-dtype": lambda weights: edit_index(weights, lambda index: index.update(dtype="float16")),
    "tensor-not-in-its-shard": lambda weights: edit_index(
        weights, lambda index: index["tensors"].append(["x", "x.weight", "weights-00000.safetensors"])
    ),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_cached_weights_fall_back_to_the_file_and_are_rewritten(damage, q4_file, caplog):
    dequantized = load(q4_file, torch.bfloat16)
    weights = unpacked_dir(q4_file) / "weights-bfloat16"
    DAMAGE[damage](weights)

    with caplog.at_level(logging.WARNING, logger="shardserve.gguf"):
        assert_same_parameters(load(q4_file, torch.bfloat16), dequantized)
    assert f"ignoring the unreadable cached weights {weights}" in caplog.text

    assert read_from_cache(q4_file, torch.bfloat16)  # rewritten by the fallback load
    assert_same_parameters(load(q4_file, torch.bfloat16), dequantized)
    assert [p.name for p in weights.parent.iterdir() if p.name.startswith(".weights-bfloat16-")] == []


@pytest.mark.parametrize("content", ['{"version": 1, "fie', '{"version": 1, "fields": {"vocab_size": 3}}',
                                     '{"version": 0, "fields": {}}'], ids=["garbled", "missing-fields", "older"])
def test_a_damaged_cached_config_falls_back_to_the_metadata_and_is_rewritten(content, q4_file, caplog):
    config = load_model_config(q4_file)
    cached = unpacked_dir(q4_file) / "model_config.json"
    cached.write_text(content)

    with caplog.at_level(logging.WARNING, logger="shardserve.gguf"):
        assert load_model_config(q4_file) == config
    assert "ignoring the unreadable cached config" in caplog.text
    assert json.loads(cached.read_text())["version"] == engine.checkpoint.gguf_cache.FORMAT_VERSION


def test_a_damaged_cached_tokenizer_falls_back_to_the_metadata_and_is_rewritten(q4_file, caplog, monkeypatch):
    expected = load_tokenizer(q4_file).encode("héllo wörld")
    (unpacked_dir(q4_file) / "tokenizer" / "tokenizer.json").write_text('{"model": {"vocab": ')

    with caplog.at_level(logging.WARNING, logger="shardserve.gguf"):
        assert load_tokenizer(q4_file).encode("héllo wörld") == expected
    assert "ignoring the unreadable cached tokenizer" in caplog.text

    forbid_reading_the_gguf(monkeypatch)
    assert load_tokenizer(q4_file).encode("héllo wörld") == expected  # the rewritten copy


def test_a_crashed_writers_staging_folder_is_neither_read_nor_left_behind(q4_file):
    folder = unpacked_dir(q4_file)
    leftover = folder / ".weights-float32-crashed"
    leftover.mkdir(parents=True)
    (leftover / "weights-00000.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")

    dequantized = load(q4_file, torch.float32)

    assert not leftover.exists()
    assert read_from_cache(q4_file, torch.float32)
    assert_same_parameters(load(q4_file, torch.float32), dequantized)


def test_a_load_stopped_midway_leaves_no_cache_and_no_lock(q4_file):
    walk = checkpoint_tensors(q4_file, load_model_config(q4_file), torch.float32)
    next(walk), next(walk)
    walk.close()  # e.g. the loader raised on a tensor of the wrong shape

    folder = unpacked_dir(q4_file)
    assert not (folder / "weights-float32").exists()
    assert [p.name for p in folder.iterdir() if p.name.startswith(".weights-float32-")] == []
    load(q4_file, torch.float32)  # the lock was released: this load writes the cache
    assert read_from_cache(q4_file, torch.float32)


def test_while_another_process_writes_the_weights_a_load_only_dequantizes(q4_file):
    folder = unpacked_dir(q4_file)
    folder.mkdir(parents=True)
    with open(folder / ".weights-float32.lock", "w") as lock:  # another open file: flock conflicts as across processes
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        dequantized = load(q4_file, torch.float32)
        assert not (folder / "weights-float32").exists()
    load(q4_file, torch.float32)
    assert_same_parameters(load(q4_file, torch.float32), dequantized)
    assert read_from_cache(q4_file, torch.float32)


def test_a_cache_that_cannot_be_written_only_warns(q4_file, monkeypatch, caplog):
    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(engine.checkpoint.gguf_cache, "save_file", disk_full)
    with caplog.at_level(logging.WARNING, logger="shardserve.gguf"):
        params = load(q4_file, torch.float32)
    assert "No space left on device" in caplog.text
    folder = unpacked_dir(q4_file)
    assert sorted(p.name for p in folder.iterdir() if "weights" in p.name) == [".weights-float32.lock"]
    monkeypatch.undo()
    monkeypatch.setenv("SHARDSERVE_CACHE", str(q4_file.parent / "cache"))
    assert_same_parameters(load(q4_file, torch.float32), params)  # this one writes the cache
    assert read_from_cache(q4_file, torch.float32)


def test_weights_that_would_nearly_fill_the_disk_are_not_cached(q4_file, monkeypatch, caplog):
    size = engine.checkpoint.gguf_cache.unpacked_size(q4_file, torch.float32)
    free = size + engine.checkpoint.gguf_cache.DISK_HEADROOM_BYTES - 1
    monkeypatch.setattr(
        engine.checkpoint.gguf_cache.shutil, "disk_usage", lambda path: SimpleNamespace(free=free)
    )
    with caplog.at_level(logging.WARNING, logger="shardserve.gguf"):
        params = load(q4_file, torch.float32)
    assert "not caching the weights" in caplog.text and "GiB free" in caplog.text
    assert not (unpacked_dir(q4_file) / "weights-float32").exists()
    assert size == sum(t.numel() * 4 for t in params.values())  # the tiny Llama is untied: nothing shared


def test_a_changed_file_is_a_new_cache_entry(tiny_llama_dir, tiny_qwen2_dir, tmp_path):
    file = write_gguf(tiny_llama_dir, tmp_path / "model.gguf")
    llama_entry = unpacked_dir(file)
    assert load_model_config(file).architecture == "llama"

    stat = file.stat()
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # same bytes, touched
    assert unpacked_dir(file) != llama_entry

    write_gguf(tiny_qwen2_dir, file)  # replaced by another model under the same name
    assert unpacked_dir(file) != llama_entry
    config = load_model_config(file)
    assert config.architecture == "qwen2" and config.attention_bias
    assert load_tokenizer(file).encode("héllo") == load_tokenizer(tiny_qwen2_dir).encode("héllo")


def test_unpack_gguf_fills_the_cache_so_that_no_load_reads_the_file(q4_file, monkeypatch):
    folder = unpack_gguf(q4_file, torch.bfloat16)
    assert folder == unpacked_dir(q4_file)
    assert {p.name for p in folder.iterdir() if not p.name.startswith(".")} == {
        "model_config.json", "tokenizer", "weights-bfloat16"
    }
    assert unpack_gguf(q4_file, torch.bfloat16) == folder  # again: nothing to do
    forbid_reading_the_gguf(monkeypatch)
    load_model_config(q4_file), load_tokenizer(q4_file), load(q4_file, torch.bfloat16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_output_through_the_cache_equals_the_uncached_engine(dtype, q4_file):
    prompts = random_prompts([3, 17, 40], seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    uncached = LLM(model=str(q4_file), dtype=dtype, max_num_batched_tokens=32)
    expected = [o.outputs[0].token_ids for o in uncached.generate(prompts, params)]
    assert_diverse(expected)
    assert read_from_cache(q4_file, getattr(torch, dtype))

    cached = LLM(model=str(q4_file), dtype=dtype, max_num_batched_tokens=32)
    assert [o.outputs[0].token_ids for o in cached.generate(prompts, params)] == expected


def test_tensor_parallel_ranks_load_the_cached_weights_token_exact(q4_file):
    """Rank 0 (this process) and rank 1 (a Ray actor) race to write the cache on the first load; the
    second load's ranks cut their shards from it."""
    prompts = random_prompts([5, 33], seed=9)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = []
    for _ in range(2):
        llm = LLM(model=str(q4_file), dtype="float32", tensor_parallel_size=2)
        try:
            outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        finally:
            llm.shutdown()
        folder = unpacked_dir(q4_file)
        assert read_from_cache(q4_file, torch.float32)
        assert [p.name for p in folder.iterdir() if p.name.startswith(".weights-float32-")] == []
    assert_diverse(outputs[0])
    assert outputs[1] == outputs[0]
