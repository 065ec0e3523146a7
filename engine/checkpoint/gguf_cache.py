"""A GGUF file unpacked once on disk, so that later loads neither parse it nor dequantize.

Reading a GGUF file costs seconds on every load: the metadata parse walks the token tables (about 3 s
for a 49k vocabulary), transformers converts the tokenizer (about 1 s), and each tensor is
dequantized. The first load of a file keeps what it computed in one folder per file identity,
`cache_root()/gguf/<stem>-<size>-<mtime_ns>/` (an edited or replaced file is a new identity):

    model_config.json    ModelConfig's fields, as engine.checkpoint.gguf.model_config_fields reads them
    tokenizer/           the converted tokenizer (save_pretrained)
    weights-<dtype>/     the dequantized weights in one serving dtype (bfloat16, float32, ...), under
                         Hugging Face's names, q/k rows unpermuted: safetensors shards of about
                         1 GiB and index.json, the tensors in the file's order and which shard holds each

Each part is written under a temporary name in that folder and renamed into place, so a reader
never sees half of one. A part that does not read back (damaged, or an older format) is logged,
the GGUF file is read instead, and the part is rewritten. Weights: the first process to load a
file in a dtype takes that dtype's lock and writes the shards as it dequantizes, one shard held in
memory at a time; a process that finds the lock taken (another tensor-parallel rank) only
dequantizes. Cached weights load as safetensors slices, so a rank reads only its shard.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from engine.checkpoint.cache_dir import cache_root
from engine.checkpoint.gguf import (
    build_gguf_tokenizer,
    gguf_checkpoint_tensors,
    hf_tensor_name,
    model_config_fields,
    open_gguf,
)
from engine.checkpoint.tokenizer_files import pretrained_tokenizer
from engine.config import ModelConfig
from parallel.layers import CheckpointTensor

logger = logging.getLogger("shardserve.gguf")

FORMAT_VERSION = 1  # of model_config.json and index.json; another version is not read
SHARD_BYTES = 1 << 30  # a shard is written once this much is pending: the writer's extra memory
DISK_HEADROOM_BYTES = 1 << 30  # weights are not cached when the disk would have less free afterwards


CONFIG_FILE = "model_config.json"  # the parts of a cache folder, as the docstring above lays them out
TOKENIZER_FILE = "tokenizer/tokenizer.json"


def weights_dir(file: str | Path, dtype: torch.dtype) -> Path:
    """The folder of a GGUF file's weights unpacked in `dtype`."""
    return unpacked_dir(file) / f"weights-{dtype_name(dtype)}"


def unpacked_dir(file: str | Path) -> Path:
    """The cache folder of a GGUF file: its name, size and modification time are its identity."""
    path = Path(file)
    stat = path.stat()
    return cache_root() / "gguf" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- config ------------------------------------------------------------------------------------


def unpacked_config_fields(file: str | Path) -> dict:
    """ModelConfig's fields of a GGUF file: from the cache, else from its metadata (then cached)."""
    cached = unpacked_dir(file) / CONFIG_FILE
    if cached.is_file():
        try:
            return _read_config_fields(cached)
        except Exception as e:  # whatever is wrong with the cache, the file itself still loads
            logger.warning("ignoring the unreadable cached config %s (%s): reading %s", cached, e, file)
    fields = model_config_fields(file)
    with _failures_logged(f"caching the config of {file} in {cached}"):
        cached.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(cached, json.dumps({"version": FORMAT_VERSION, "fields": fields}, indent=1))
    return fields


def _read_config_fields(cached: Path) -> dict:
    document = json.loads(cached.read_text())
    if document.get("version") != FORMAT_VERSION:
        raise ValueError(f"format version {document.get('version')!r}, expected {FORMAT_VERSION}")
    fields = document["fields"]
    ModelConfig(**fields)  # raises on a missing or mistyped field
    return fields


# ---- tokenizer ---------------------------------------------------------------------------------


def unpacked_tokenizer(file: str | Path):
    """A GGUF file's tokenizer: from the cache, else converted by transformers (then cached)."""
    cached = unpacked_dir(file) / "tokenizer"
    if (cached / "tokenizer.json").is_file():
        try:
            return pretrained_tokenizer(cached)
        except Exception as e:
            logger.warning("ignoring the unreadable cached tokenizer %s (%s): reading %s", cached, e, file)
    tokenizer = build_gguf_tokenizer(file)
    with _failures_logged(f"caching the tokenizer of {file} in {cached}"):
        unreadable = cached.exists()
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=cached.parent))
        try:
            tokenizer.save_pretrained(str(staging))
            _publish(staging, cached, replace=unreadable)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone already once published
    return tokenizer


# ---- weights -----------------------------------------------------------------------------------


def unpacked_tensors(
    file: str | Path, num_attention_heads: int, num_key_value_heads: int, dtype: torch.dtype
) -> Iterator[tuple[str, str, CheckpointTensor | None]]:
    """(where it came from, Hugging Face name, tensor or safetensors slice) per tensor of a GGUF file,
    for an engine serving in `dtype`: slices of the cached weights, else the file's tensors
    dequantized to float32 (written to the cache as they pass, unless another process writes it).
    Both give the same parameters: float32 rounded to `dtype` once, here or in the weight loader."""
    file = Path(file)
    folder = weights_dir(file, dtype)
    unreadable = folder.exists()
    with contextlib.ExitStack() as open_files:
        cached = _open_weights(folder, dtype, open_files, file) if unreadable else None
        if cached is not None:
            for gguf_name, name, tensor, shard in cached:
                yield f"{gguf_name} in {file.name} (unpacked in {folder / (shard or '')})", name, tensor
            return
    writer = _WeightsWriter.start(folder, dtype, replace=unreadable, size=unpacked_size(file, dtype))
    try:
        for gguf_name, name, tensor in gguf_checkpoint_tensors(file, num_attention_heads, num_key_value_heads):
            if writer is not None and not writer.add(gguf_name, name, tensor):
                writer.close()
                writer = None
            yield f"{gguf_name} in {file.name}", name, tensor
        if writer is not None:
            writer.commit()
    finally:
        if writer is not None:
            writer.close()


def unpacked_size(file: str | Path, dtype: torch.dtype) -> int:
    """Bytes the file's weights take unpacked in `dtype` (from the tensor list: nothing is dequantized)."""
    element = torch.empty(0, dtype=dtype).element_size()
    return sum(int(t.n_elements) * element for t in open_gguf(file).tensors if hf_tensor_name(t.name))


def _open_weights(weights_dir: Path, dtype: torch.dtype, open_files: contextlib.ExitStack, file) -> list | None:
    """[(GGUF name, Hugging Face name, slice or None, shard)] of a cached weights folder; None (and a
    warning) when it does not read back."""
    try:
        index = json.loads((weights_dir / "index.json").read_text())
        if index.get("version") != FORMAT_VERSION or index.get("dtype") != dtype_name(dtype):
            raise ValueError(f"format {index.get('version')!r} in {index.get('dtype')!r}, "
                             f"expected {FORMAT_VERSION} in {dtype_name(dtype)!r}")
        shards = {
            shard: open_files.enter_context(safe_open(str(weights_dir / shard), framework="pt", device="cpu"))
            for shard in {shard for _, _, shard in index["tensors"] if shard is not None}
        }
        expected = dtype_name(dtype)
        tensors = []
        for gguf_name, name, shard in index["tensors"]:
            tensor = None if shard is None else shards[shard].get_slice(name)  # header only: no data read
            if tensor is not None and _SAFETENSORS_DTYPES.get(tensor.get_dtype()) != expected:
                raise ValueError(f"{name} is {tensor.get_dtype()}")
            tensors.append((gguf_name, name, tensor, shard))
        return tensors
    except Exception as e:
        logger.warning("ignoring the unreadable cached weights %s (%s): dequantizing %s", weights_dir, e, file)
        open_files.close()
        return None


_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


class _WeightsWriter:
    """One process's writing of a weights folder: shards into a staging folder, renamed into place
    whole by commit(). Holds the folder's lock from start() to close()."""

    def __init__(self, weights_dir: Path, dtype: torch.dtype, lock, replace: bool):
        self.weights_dir = weights_dir
        self.dtype = dtype
        self.lock = lock
        self.replace = replace  # the folder there failed to read back
        self.staging = Path(tempfile.mkdtemp(prefix=f".{weights_dir.name}-", dir=weights_dir.parent))
        self.index: list[tuple[str, str, str | None]] = []  # (GGUF name, Hugging Face name, shard)
        self.pending: dict[str, torch.Tensor] = {}  # the shard being filled
        self.pending_bytes = 0
        self.num_shards = 0

    @classmethod
    def start(cls, weights_dir: Path, dtype: torch.dtype, replace: bool, size: int) -> _WeightsWriter | None:
        """A writer of `size` bytes of weights, or None when another process is writing this folder (or
        has just written it), or it cannot be written. `replace`: the folder there failed to read back."""
        lock = None
        try:
            weights_dir.parent.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(weights_dir.parent).free
            if free < size + DISK_HEADROOM_BYTES:
                logger.warning("not caching the weights in %s: they take %.1f GiB and the disk has %.1f GiB free",
                               weights_dir, size / 2**30, free / 2**30)
                return None
            lock = open(weights_dir.parent / f".{weights_dir.name}.lock", "w")
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if lock is not None:
                lock.close()
            if not isinstance(e, BlockingIOError):
                logger.warning("not caching the weights in %s: %s", weights_dir, e)
            return None
        if weights_dir.exists() and not replace:  # written while this process took the lock
            lock.close()
            return None
        # Under the lock no other process writes here: staging folders left are from a crashed writer.
        for leftover in weights_dir.parent.glob(f".{weights_dir.name}-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        try:
            return cls(weights_dir, dtype, lock, replace)
        except OSError as e:
            logger.warning("not caching the weights in %s: %s", weights_dir, e)
            lock.close()
            return None

    def add(self, gguf_name: str, name: str, tensor: torch.Tensor | None) -> bool:
        """Keep one tensor (converted to the dtype); False if writing failed (the writer is then done)."""
        if tensor is None:  # not a weight the engine loads (e.g. rope_freqs): only listed
            self.index.append((gguf_name, name, None))
            return True
        converted = tensor.to(self.dtype).contiguous()
        size = converted.numel() * converted.element_size()
        if self.pending and self.pending_bytes + size > SHARD_BYTES:
            if not self._write_shard():
                return False
        self.pending[name] = converted
        self.pending_bytes += size
        self.index.append((gguf_name, name, self._shard_name(self.num_shards)))
        return True

    def commit(self) -> None:
        """Write the last shard and the index, then rename the folder into place."""
        if self.pending and not self._write_shard():
            return
        index = {"version": FORMAT_VERSION, "dtype": dtype_name(self.dtype), "tensors": self.index}
        with _failures_logged(f"caching the weights in {self.weights_dir}"):
            (self.staging / "index.json").write_text(json.dumps(index, indent=0))
            if _publish(self.staging, self.weights_dir, replace=self.replace):
                logger.info("cached the dequantized weights in %s", self.weights_dir)

    def close(self) -> None:
        """Drop what was not committed and release the lock."""
        shutil.rmtree(self.staging, ignore_errors=True)
        self.pending.clear()
        self.lock.close()

    def _write_shard(self) -> bool:
        try:
            save_file(self.pending, str(self.staging / self._shard_name(self.num_shards)), metadata={"format": "pt"})
        except (OSError, SafetensorError) as e:  # e.g. a full disk: the load goes on without the cache
            logger.warning("not caching the weights in %s: %s", self.weights_dir, e)
            return False
        self.pending = {}
        self.pending_bytes = 0
        self.num_shards += 1
        return True

    @staticmethod
    def _shard_name(number: int) -> str:
        return f"weights-{number:05d}.safetensors"


# ---- all of it, ahead of time ------------------------------------------------------------------


def unpack_gguf(file: str | Path, dtype: torch.dtype) -> Path:
    """Fill a GGUF file's cache folder for an engine serving in `dtype` (what is there already is kept)."""
    config = ModelConfig(**unpacked_config_fields(file))
    cache = unpacked_dir(file)
    if not (cache / TOKENIZER_FILE).is_file():
        unpacked_tokenizer(file)
    for _ in unpacked_tensors(file, config.num_attention_heads, config.num_key_value_heads, dtype):
        pass
    return cache


# ---- writing -----------------------------------------------------------------------------------


def _write_atomically(target: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=target.parent, prefix=f".{target.name}-", delete=False) as f:
        f.write(text)
    os.replace(f.name, target)


def _publish(staging: Path, target: Path, replace: bool) -> bool:
    """Rename a finished staging folder to `target`; False when one was already there (another
    process's, with the same content: ours is dropped). With `replace` the one there failed to read
    back: it is moved aside and deleted."""
    try:
        os.replace(staging, target)  # fails if target is a folder that is not empty
        return True
    except OSError:
        if not (replace and target.exists()):
            shutil.rmtree(staging, ignore_errors=True)
            if target.exists():
                return False
            raise
    stale = Path(tempfile.mkdtemp(prefix=f".{target.name}-stale-", dir=target.parent))
    os.replace(target, stale / target.name)
    os.replace(staging, target)
    shutil.rmtree(stale, ignore_errors=True)
    return True


@contextlib.contextmanager
def _failures_logged(what: str):
    """The cache is an optimisation: failing to write it (read-only or full disk) only warns."""
    try:
        yield
    except OSError as e:
        logger.warning("%s failed: %s", what, e)
