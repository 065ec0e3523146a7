"""The GPU path's Python never waits for the device inside a forward pass: no host sync in the Triton
wrappers (kernels/*_triton.py, outside their @triton.jit bodies), the model code (engine/models/,
engine/attention.py, parallel/layers.py) or the runner's forward (ModelRunner.compute_logits, StepInput.to).
A sync there stalls the CPU until the GPU drains its queue, every layer of every step, and it cannot be
captured in a CUDA graph. (Sampling ends the step with one: the tokens come back to the host.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
WHOLE_FILES = sorted(
    [*ROOT.glob("kernels/*_triton.py"), *ROOT.glob("engine/models/*.py"), ROOT / "engine/attention.py",
     ROOT / "parallel/layers.py"]
)
FUNCTIONS = {ROOT / "engine/model_runner.py": {"compute_logits", "to", "_host_to_device"}}

# methods that copy a tensor's data to the host, or wait for the device
SYNCING_METHODS = {"item", "tolist", "cpu", "numpy", "nonzero", "synchronize", "equal", "allclose"}
# reductions whose value, turned into a Python number or truth value, is a sync
REDUCTIONS = {"max", "min", "sum", "any", "all", "amax", "amin", "argmax", "argmin", "mean", "count_nonzero"}


def _is_jit(node: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(decorator) for decorator in node.decorator_list)


def _host_syncs(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in SYNCING_METHODS:
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(func, ast.Attribute) and func.attr == "to" and any(
            isinstance(arg, ast.Constant) and arg.value == "cpu" for arg in [*node.args, *(k.value for k in node.keywords)]
        ):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(func, ast.Name) and func.id in ("int", "float", "bool") and node.args:
            inner = [n for n in ast.walk(node.args[0]) if isinstance(n, ast.Call)]
            if any(isinstance(n.func, ast.Attribute) and n.func.attr in REDUCTIONS for n in inner):
                found.append((node.lineno, ast.unparse(node)))
    return found


def _scanned(path: Path) -> list[ast.AST]:
    """The code of `path` that runs on the host in a forward pass."""
    tree = ast.parse(path.read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    if path in FUNCTIONS:
        return [f for f in functions if f.name in FUNCTIONS[path]]
    jit_bodies = {id(n) for f in functions if _is_jit(f) for n in ast.walk(f)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and id(n) not in jit_bodies]


@pytest.mark.parametrize("path", [*WHOLE_FILES, *FUNCTIONS], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_host_sync_in_the_forward_path(path):
    syncs = [sync for node in _scanned(path) for sync in _host_syncs(node)]
    assert syncs == [], f"{path.relative_to(ROOT)} waits for the device at: {sorted(set(syncs))}"


def test_the_scan_finds_each_kind_of_sync():
    code = "def f(x):\n    a = x.item()\n    b = int(x.max())\n    c = x.to('cpu')\n    d = bool((x > 0).any())\n"
    assert [line for line, _ in _host_syncs(ast.parse(code))] == [2, 3, 4, 5]
    assert _host_syncs(ast.parse("def f(x, n):\n    return int(n) + x.shape[0]\n")) == []
