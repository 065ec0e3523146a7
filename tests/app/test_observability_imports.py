"""app/observability depends one way: records <- metrics, records <- tracing, replica over them, metrics <- routing
(the ingress's); nothing else in
the subpackage imports a sibling, not even inside a function or under TYPE_CHECKING."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "app" / "observability"
# each module and the siblings it may import
ALLOWED = {
    "__init__": set(),
    "records": set(),
    "metrics": {"records"},
    "tracing": {"records"},
    "replica": {"records", "metrics", "tracing"},
    "routing": {"metrics"},
}


def sibling_imports(file: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[:2] == ["app", "observability"]:
                found |= {parts[2]} if len(parts) > 2 else {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[2] for alias in node.names
                      if alias.name.startswith("app.observability.")}
    return found


def test_every_observability_module_imports_only_the_siblings_below_it():
    modules = {file.stem: sibling_imports(file) for file in PACKAGE.glob("*.py")}
    assert set(modules) == set(ALLOWED)
    assert {name: imports - ALLOWED[name] for name, imports in modules.items()} == {name: set() for name in ALLOWED}
