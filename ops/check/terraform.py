"""Terraform modules as data: declared variables, references, module calls, and a partial evaluator.

The evaluator folds literals, `var.*`, `local.*`, simple templates and a few functions
(yamlencode, jsonencode, concat, merge, tostring, lookup). Anything else is UNKNOWN, so a check
that needs a value it cannot see says so instead of guessing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ops.check.hcl import Attribute, Block, Body, Call, Raw, Ref, Template, parse_value, read_file, references

MODULE_META_ARGUMENTS = {"source", "version", "providers", "depends_on", "count", "for_each"}


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN = _Unknown()


@dataclass
class Module:
    """One directory of .tf files."""

    dir: Path
    blocks: list[Block] = field(default_factory=list)

    def of_type(self, type_: str, *labels: str) -> list[Block]:
        return [b for b in self.blocks if b.type == type_ and tuple(b.labels[: len(labels)]) == labels]

    @property
    def variables(self) -> dict[str, Block]:
        return {b.labels[0]: b for b in self.of_type("variable")}

    @property
    def locals(self) -> dict[str, Attribute]:
        return {name: a for b in self.of_type("locals") for name, a in b.body.attributes.items()}

    def module_calls(self) -> dict[str, Block]:
        return {b.labels[0]: b for b in self.of_type("module")}

    def defaults(self) -> dict[str, Any]:
        """Variable defaults; a variable without one is UNKNOWN until a caller sets it."""
        out = {}
        for name, block in self.variables.items():
            attr = block.body.attributes.get("default")
            out[name] = evaluate(attr.value, Scope({}, {})) if attr else UNKNOWN
        return out

    def required_variables(self) -> set[str]:
        return {name for name, b in self.variables.items() if "default" not in b.body.attributes}

    def variable_uses(self) -> dict[str, list[tuple[Path, int]]]:
        """Where each `var.NAME` is read, outside the variable blocks themselves."""
        uses: dict[str, list[tuple[Path, int]]] = {}
        for block in self.blocks:
            if block.type == "variable":
                continue
            for attr, path in _attributes(block):
                for name in references(attr.text, "var"):
                    uses.setdefault(name, []).append((path, attr.line))
        return uses


def _attributes(block: Block) -> Iterator[tuple[Attribute, Path]]:
    for attr in block.body.attributes.values():
        yield attr, block.path
    for inner in block.body.blocks:
        inner.path = block.path
        yield from _attributes(inner)


def load_module(directory: Path) -> Module:
    """All top-level blocks of the .tf files in `directory` (not recursive)."""
    module = Module(directory)
    for path in sorted(directory.glob("*.tf")):
        module.blocks.extend(read_file(path).blocks)
    return module


def module_dirs(root: Path) -> list[Path]:
    """Every directory under `root` holding .tf files."""
    return sorted({p.parent for p in root.rglob("*.tf") if ".terraform" not in p.parts})


# --- evaluation -----------------------------------------------------------------------------


@dataclass
class Scope:
    variables: dict[str, Any]
    locals: dict[str, Attribute]
    _local_values: dict[str, Any] = field(default_factory=dict)
    _evaluating: set[str] = field(default_factory=set)

    def local(self, name: str) -> Any:
        if name in self._local_values:
            return self._local_values[name]
        if name not in self.locals or name in self._evaluating:
            return UNKNOWN
        self._evaluating.add(name)
        value = evaluate(self.locals[name].value, self)
        self._evaluating.discard(name)
        self._local_values[name] = value
        return value


def module_scope(module: Module, inputs: dict[str, Any] | None = None) -> Scope:
    """The scope of `module` called with `inputs` (defaults for the rest)."""
    variables = module.defaults()
    variables.update(inputs or {})
    return Scope(variables, module.locals)


def _index(value: Any, keys: tuple[str, ...]) -> Any:
    for key in keys:
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return UNKNOWN
    return value


def contains_unknown(value: Any) -> bool:
    if value is UNKNOWN:
        return True
    if isinstance(value, dict):
        return any(contains_unknown(v) for v in value.values())
    if isinstance(value, list):
        return any(contains_unknown(v) for v in value)
    return False


def _to_plain(value: Any) -> Any:
    """Terraform's view of numbers: 8.0 and 8 are one number."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_plain(v) for v in value]
    return value


def _call(name: str, args: list[Any]) -> Any:
    if any(contains_unknown(a) for a in args):
        return UNKNOWN
    if name == "yamlencode" and len(args) == 1:
        return yaml.safe_dump(_to_plain(args[0]), sort_keys=False)
    if name == "jsonencode" and len(args) == 1:
        return json.dumps(_to_plain(args[0]))
    if name == "concat" and all(isinstance(a, list) for a in args):
        return [item for a in args for item in a]
    if name == "merge" and all(isinstance(a, dict) for a in args):
        return {k: v for a in args for k, v in a.items()}
    if name == "tostring" and len(args) == 1 and isinstance(args[0], (str, int, float)):
        return str(_to_plain(args[0]))
    if name == "lookup" and len(args) in (2, 3) and isinstance(args[0], dict):
        return args[0].get(args[1], args[2] if len(args) == 3 else UNKNOWN)
    return UNKNOWN


def _template(text: str, scope: Scope) -> Any:
    whole = re.fullmatch(r"\$\{([^{}]*)\}", text)
    if whole:
        return evaluate(parse_value(whole.group(1)), scope)
    parts, pos = [], 0
    for m in re.finditer(r"\$\{([^{}]*)\}", text):
        value = evaluate(parse_value(m.group(1)), scope)
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            return UNKNOWN
        parts += [text[pos:m.start()], str(_to_plain(value))]
        pos = m.end()
    if "%{" in text:
        return UNKNOWN
    return "".join(parts) + text[pos:]


def evaluate(value: Any, scope: Scope) -> Any:
    """The value of a parsed expression in `scope`, UNKNOWN where it cannot be folded."""
    if isinstance(value, dict):
        return {k: evaluate(v, scope) for k, v in value.items()}
    if isinstance(value, list):
        return [evaluate(v, scope) for v in value]
    if isinstance(value, Ref):
        root, *rest = value.parts
        if root == "var" and rest:
            return _index(scope.variables.get(rest[0], UNKNOWN), tuple(rest[1:]))
        if root == "local" and rest:
            return _index(scope.local(rest[0]), tuple(rest[1:]))
        return UNKNOWN
    if isinstance(value, Template):
        return _template(value.text, scope)
    if isinstance(value, Call):
        return _call(value.name, [evaluate(a, scope) for a in value.args])
    if isinstance(value, Raw):
        m = re.fullmatch(r"(var|local)\.([A-Za-z_][\w-]*)\[(.+)\]", value.text.strip())
        if m:  # a map indexed by an expression: var.gpu_instance_types[tostring(var.tensor_parallel_size)]
            container = evaluate(Ref((m.group(1), m.group(2))), scope)
            key = evaluate(parse_value(m.group(3)), scope)
            if isinstance(key, (int, float)) and not isinstance(key, bool):
                key = str(_to_plain(key)) if isinstance(container, dict) else str(int(key))
            return _index(container, (key,)) if isinstance(key, str) else UNKNOWN
        return UNKNOWN
    return value


def body_values(body: Body, scope: Scope) -> dict[str, Any]:
    """Every attribute of a block body, evaluated."""
    return {name: evaluate(attr.value, scope) for name, attr in body.attributes.items()}
