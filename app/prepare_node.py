"""`shardserve prepare-node`: what a node runs before Ray starts on it, so that a replica placed there finds its model.

A replica loads the model from the path its settings give (`model`, or the demo model in the cache folder) on
the node it lands on, and a GGUF file is unpacked (engine/checkpoint/gguf_cache.py) into that node's cache folder
(`$SHARDSERVE_CACHE`, else `~/.cache/shardserve`) on its first load: seconds of parsing and dequantizing at
replica start, in every new pod. This step does that work ahead of time, with the settings the replicas get
(the same flags as `shardserve serve`; only the model, `--dtype` and `--device` matter here): it resolves the
model path (fetching the demo model once, the only download there is), checks that it loads as a model, and
for a GGUF file fills the cache for the dtype the replicas will serve in. Run again, it finds the cache and
keeps it. A Hugging Face directory needs no unpacking: the step only checks it is there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.config import ServeArgs
from app.deployment import model_path
from engine.checkpoint.gguf import find_gguf_file
from engine.checkpoint.gguf_cache import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    dtype_name,
    unpack_gguf,
    unpacked_dir,
    weights_dir,
)
from engine.checkpoint.model_config import load_model_config


@dataclass(frozen=True)
class PreparedModel:
    """What a replica on this node will load: the model path, and for a GGUF file its unpacked cache."""

    model: Path
    gguf_cache: Path | None  # None: a Hugging Face directory, loaded as it is
    dtype: str
    reused: bool  # the cache was complete already: nothing was unpacked
    weights_cached: bool  # False: the weights could not be written (disk full or read-only): each start dequantizes

    def describe(self) -> str:
        if self.gguf_cache is None:
            return f"model {self.model}: a Hugging Face directory, loaded as it is ({self.dtype})"
        state = "already unpacked, kept" if self.reused else "unpacked"
        weights = "" if self.weights_cached else "; the weights could not be cached: each replica start dequantizes"
        return f"model {self.model}: {state} in {self.gguf_cache} ({self.dtype}){weights}"


def prepare_node(args: ServeArgs) -> PreparedModel:
    """Resolve the replicas' model on this node and unpack a GGUF file into this node's cache (idempotent)."""
    model = Path(model_path(args))  # the demo model: fetched once into the cache folder
    gguf_file = find_gguf_file(model)
    cache = unpacked_dir(gguf_file) if gguf_file is not None else None
    # looked at before the config is read: reading a GGUF file's config caches it
    had_parts = cache is not None and all((cache / part).is_file() for part in (CONFIG_FILE, TOKENIZER_FILE))
    model_config = load_model_config(model)  # a missing or broken model fails here, before Ray starts
    dtype = args.engine_config(str(model)).torch_dtype(model_config)
    if gguf_file is None or cache is None:
        return PreparedModel(model, None, dtype_name(dtype), reused=True, weights_cached=True)
    weights_index = weights_dir(gguf_file, dtype) / "index.json"
    reused = had_parts and weights_index.is_file()
    unpack_gguf(gguf_file, dtype)  # reads only what is missing (a complete cache: headers, no tensor data)
    return PreparedModel(gguf_file, cache, dtype_name(dtype), reused, weights_cached=weights_index.is_file())
