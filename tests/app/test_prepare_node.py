"""`shardserve prepare-node` (app/prepare_node.py), the per-node step before Ray starts, on a fresh node: HOME is
an empty folder, so the node's cache (~/.cache/shardserve) starts empty, as in a new KubeRay pod. The step
unpacks the GGUF file there; a replica on that node then loads the model without reading the file; a second
run keeps the cache as it is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch

from app.cli import main
from engine.checkpoint.loader import load_model, load_tokenizer
from engine.checkpoint.model_config import load_model_config
from kernels.backend import get_backend
from parallel.state import ParallelContext
from tests.engine.gguf_files import write_gguf
from tests.engine.test_gguf_cache import forbid_reading_the_gguf


@pytest.fixture
def fresh_node(tmp_path, monkeypatch) -> Path:
    """This process and its children as a new node: HOME empty, no SHARDSERVE_CACHE."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SHARDSERVE_CACHE", raising=False)
    return home


@pytest.fixture
def tiny_gguf(tiny_llama_dir, tmp_path) -> Path:
    (tmp_path / "models").mkdir()
    return write_gguf(tiny_llama_dir, tmp_path / "models" / "tiny.Q4_1.gguf", quant=gguf.GGMLQuantizationType.Q4_1)


def prepare_node(*args: str) -> str:
    """`shardserve prepare-node ARGS` in a process of its own, as a node's init step runs it; its stdout."""
    out = subprocess.run([sys.executable, "-m", "app.cli", "prepare-node", *args], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def files_with_mtimes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_a_fresh_node_unpacks_the_gguf_into_its_cache_and_a_replica_there_loads_without_reading_the_file(
        fresh_node, tiny_gguf, monkeypatch):
    cache_root = fresh_node / ".cache" / "shardserve" / "gguf"
    assert not cache_root.exists()
    first = prepare_node("--model", str(tiny_gguf), "--device", "cpu")
    [cache] = list(cache_root.iterdir())  # one folder for the file's identity (engine/checkpoint/gguf_cache.py)
    assert f"unpacked in {cache} " in first, first
    assert (cache / "model_config.json").is_file() and (cache / "tokenizer" / "tokenizer.json").is_file()
    [weights] = list(cache.glob("weights-*"))
    assert (weights / "index.json").is_file() and list(weights.glob("*.safetensors"))
    written = files_with_mtimes(cache)

    second = prepare_node(str(tiny_gguf), "--device", "cpu")  # the model as serve takes it too: positional
    assert f"already unpacked, kept in {cache} " in second, second
    assert files_with_mtimes(cache) == written  # nothing unpacked or rewritten

    # what a replica placed on this node does at start, with the file itself made unreadable
    forbid_reading_the_gguf(monkeypatch)
    config = load_model_config(tiny_gguf)
    dtype = getattr(torch, weights.name.removeprefix("weights-"))
    model = load_model(tiny_gguf, config, dtype, "cpu", ParallelContext(), get_backend("torch"))
    assert sum(p.numel() for p in model.parameters()) > 0
    assert load_tokenizer(tiny_gguf).encode("Hello")


def test_a_hugging_face_directory_is_checked_and_nothing_is_unpacked(fresh_node, tiny_llama_dir, capsys):
    assert main(["prepare-node", "--model", str(tiny_llama_dir), "--device", "cpu"]) == 0
    assert "a Hugging Face directory, loaded as it is" in capsys.readouterr().out
    assert not (fresh_node / ".cache").exists()


def test_a_node_without_the_model_fails_its_step_saying_where_it_looked(fresh_node, tmp_path):
    missing = tmp_path / "models" / "absent"
    with pytest.raises(SystemExit) as failed:
        main(["prepare-node", "--model", str(missing), "--device", "cpu"])
    assert str(missing) in str(failed.value) and "prepare-node" in str(failed.value)
