"""The installed dependencies leave the import name `kernels` to this project's kernels/ package.

Hugging Face ships a distribution named `kernels` too (hub kernels); transformers 5.25 made it a hard dependency
and imports it at `import transformers` whenever it is installed. Both cannot be imported as `kernels` at once:
ours shadows it and transformers fails with an ImportError, so pyproject.toml keeps transformers below 5.25.
This test names the clash if a dependency ever drags that distribution in again.
"""

import importlib.metadata
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_installed_distribution_claims_the_kernels_import_name():
    try:
        version = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        version = None
    assert version is None, (
        f"Hugging Face's `kernels` {version} is installed: its import name clashes with this project's kernels/ "
        "package and `import transformers` then fails; find which dependency requires it (pip show -r) and pin "
        "that dependency below the version that does (see pyproject.toml's transformers pin)"
    )


def test_kernels_is_this_projects_package_and_transformers_imports_beside_it():
    spec = importlib.util.find_spec("kernels")
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve().parent == ROOT / "kernels"
    from transformers import LlamaConfig  # the lazy import that failed under transformers 5.25

    assert LlamaConfig(num_hidden_layers=1).num_hidden_layers == 1
