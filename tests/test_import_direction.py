"""The packages depend one way: app -> engine -> parallel -> kernels. A lower package never imports a
higher one, not even inside a function or under TYPE_CHECKING. The load-test tool (bench) imports none of
them; only the CLI (app) imports it, to run `shardserve bench`."""

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ["kernels", "parallel", "engine", "app"]  # each may import only those before it (and itself)
PACKAGES = [*LAYERS, "bench"]


def imported_packages(file: Path) -> set[tuple[str, int]]:
    """(top-level project package, line) of every import statement in the file, wherever it sits."""
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {(name.split(".")[0], node.lineno) for name in names if name.split(".")[0] in PACKAGES}
    return found


def allowed(package: str) -> set[str]:
    if package == "bench":
        return {"bench"}
    below = set(LAYERS[: LAYERS.index(package) + 1])
    return below | {"bench"} if package == "app" else below


def violations(package: str) -> list[str]:
    out = []
    for file in sorted((REPO / package).rglob("*.py")):
        for imported, line in sorted(imported_packages(file)):
            if imported not in allowed(package):
                out.append(f"{file.relative_to(REPO)}:{line} imports {imported}")
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_runs_against_the_direction(package):
    assert violations(package) == []


def test_the_check_sees_a_function_local_import_against_the_direction(tmp_path, monkeypatch):
    (tmp_path / "parallel").mkdir()
    (tmp_path / "parallel" / "bad.py").write_text("def f():\n    from engine.config import EngineConfig\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert violations("parallel") == ["parallel/bad.py:2 imports engine"]
