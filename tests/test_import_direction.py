"""The packages depend one way: app -> engine -> parallel -> kernels. A lower package never imports a
higher one, not even inside a function or under TYPE_CHECKING. The load-test tool (bench) imports none of
them; only the CLI (app) imports it, to run `shardserve bench`. Inside a package the modules import one
another without a circle, counting the same imports."""

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


def module_name(file: Path) -> str:
    """`engine/checkpoint/demo.py` -> `engine.checkpoint.demo`; a package's `__init__.py` is the package."""
    parts = file.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(file: Path, modules: set[str]) -> set[str]:
    """Which of `modules` the file's import statements name, wherever they sit (`from a import b` names a.b
    when that is a module, else a)."""
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [name if name in modules else node.module for name in names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def import_circles(package: str) -> list[str]:
    """Every import circle among the package's modules that a depth-first walk meets, as `a -> b -> a`."""
    files = {module_name(file): file for file in sorted((REPO / package).rglob("*.py"))}
    graph = {module: imported_modules(file, set(files)) - {module} for module, file in files.items()}
    circles, open_path, done = [], [], set()

    def walk(module: str) -> None:
        open_path.append(module)
        for imported in sorted(graph[module]):
            if imported in open_path:
                circles.append(" -> ".join([*open_path[open_path.index(imported) :], imported]))
            elif imported not in done:
                walk(imported)
        open_path.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            walk(module)
    return circles


@pytest.mark.parametrize("package", PACKAGES)
def test_no_modules_of_a_package_import_one_another_in_a_circle(package):
    assert import_circles(package) == []


def test_the_check_sees_a_circle_closed_by_a_function_local_import(tmp_path, monkeypatch):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "engine" / "a.py").write_text("from engine.b import B\n")
    (tmp_path / "engine" / "b.py").write_text("B = 1\n\n\ndef f():\n    from engine import a\n")
    (tmp_path / "engine" / "c.py").write_text("import engine.a\n")  # imports into the circle, not part of it
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert import_circles("engine") == ["engine.a -> engine.b -> engine.a"]
