"""A small HCL reader: enough of Terraform's syntax to check this repository's modules without terraform.

It reads blocks, attributes and the literal parts of expressions (strings, numbers, bools, null,
lists, objects, `var.x` / `local.x` references and function calls). Any other expression is kept
as `Raw` text. Syntax errors are the job of the real HCL parser (ops/lint-ops.sh runs hcl2json);
this reader only has to be right on files that parse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class HclReadError(ValueError):
    """The text is not HCL this reader understands."""


@dataclass(frozen=True)
class Raw:
    """An expression kept as text (a conditional, a for-expression, arithmetic, ...)."""

    text: str


@dataclass(frozen=True)
class Ref:
    """A traversal such as `var.gpu_node_max_size` or `module.gpu_cluster.cluster_name`."""

    parts: tuple[str, ...]


@dataclass(frozen=True)
class Call:
    """A function call such as `yamlencode({...})`."""

    name: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class Template:
    """A quoted string with `${...}` interpolations."""

    text: str


@dataclass
class Attribute:
    name: str
    text: str  # the expression's source text
    value: Any  # str | int | float | bool | None | list | dict | Raw | Ref | Call | Template
    line: int


@dataclass
class Block:
    type: str
    labels: list[str]
    body: Body
    path: Path
    line: int


@dataclass
class Body:
    attributes: dict[str, Attribute] = field(default_factory=dict)
    blocks: list[Block] = field(default_factory=list)

    def blocks_of(self, type_: str) -> list[Block]:
        return [b for b in self.blocks if b.type == type_]


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?$")
_TRAVERSAL = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z_][A-Za-z0-9_-]*|\[\d+\]|\[\"[^\"]*\"\])*$")
_HEREDOC = re.compile(r"<<-?([A-Za-z_][A-Za-z0-9_]*)[ \t]*\n")
_OPEN = {"(": ")", "[": "]", "{": "}"}


def _skip_string(text: str, i: int) -> int:
    """Index just past the quoted string that starts at text[i] == '"' (interpolations may nest)."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        if c == "\n":
            raise HclReadError("unterminated string")
        if text.startswith("${", i) or text.startswith("%{", i):
            i = _skip_balanced(text, i + 1)
            continue
        i += 1
    raise HclReadError("unterminated string")


def _skip_heredoc(text: str, i: int) -> int:
    m = _HEREDOC.match(text, i)
    assert m
    end = re.compile(rf"^[ \t]*{m.group(1)}[ \t]*$", re.M).search(text, m.end())
    if not end:
        raise HclReadError(f"unterminated heredoc {m.group(1)}")
    return end.end()


def _skip_comment(text: str, i: int) -> int | None:
    """Index past a comment starting at i (a line comment stops before its newline), or None."""
    if text[i] == "#" or text.startswith("//", i):
        j = text.find("\n", i)
        return len(text) if j < 0 else j
    if text.startswith("/*", i):
        j = text.find("*/", i + 2)
        if j < 0:
            raise HclReadError("unterminated /* comment")
        return j + 2
    return None


def _skip_balanced(text: str, i: int) -> int:
    """Index just past the bracket group that opens at text[i]."""
    stack = [_OPEN[text[i]]]
    i += 1
    while i < len(text):
        c = text[i]
        if c == '"':
            i = _skip_string(text, i)
            continue
        if text.startswith("<<", i) and _HEREDOC.match(text, i):
            i = _skip_heredoc(text, i)
            continue
        skipped = _skip_comment(text, i)
        if skipped is not None:
            i = skipped
            continue
        if c in _OPEN:
            stack.append(_OPEN[c])
        elif c in ")]}":
            if c != stack.pop():
                raise HclReadError(f"unbalanced {c!r}")
            if not stack:
                return i + 1
        i += 1
    raise HclReadError("unclosed bracket")


def _scan_expression(text: str, i: int, stops: str) -> int:
    """Index where the expression starting at i ends: a newline or one of `stops` at depth 0."""
    while i < len(text):
        c = text[i]
        if c == "\n" or c in stops:
            return i
        if c == '"':
            i = _skip_string(text, i)
        elif text.startswith("<<", i) and _HEREDOC.match(text, i):
            i = _skip_heredoc(text, i)
        elif c in _OPEN:
            i = _skip_balanced(text, i)
        elif (skipped := _skip_comment(text, i)) is not None:
            if not text.startswith("/*", i):
                return i  # a line comment ends the expression
            i = skipped
        else:
            i += 1
    return i


def strip_comments(text: str) -> str:
    """The expression text without comments (strings are kept)."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == '"':
            j = _skip_string(text, i)
            out.append(text[i:j])
            i = j
            continue
        if text.startswith("<<", i) and _HEREDOC.match(text, i):
            j = _skip_heredoc(text, i)
            out.append(text[i:j])
            i = j
            continue
        skipped = _skip_comment(text, i)
        if skipped is not None:
            i = skipped
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _split_items(inner: str) -> list[str]:
    """Items of a list or object body, separated by commas or newlines at depth 0."""
    items, i = [], 0
    while i < len(inner):
        j = _scan_expression(inner, i, ",")
        item = strip_comments(inner[i:j]).strip()
        if item:
            items.append(item)
        i = j + 1
    return items


def _object_key(text: str) -> tuple[str, str] | None:
    """(key, value text) when `text` is one `key = value` / `key: value` object item."""
    m = re.match(r'\s*("(?:[^"\\]|\\.)*"|[A-Za-z_][A-Za-z0-9_-]*|\([^)]*\))\s*(=(?!=)|:)', text)
    if not m:
        return None
    key = m.group(1)
    if key.startswith('"'):
        key = parse_value(key)
        if not isinstance(key, str):
            return None
    return key, text[m.end():]


def parse_value(text: str) -> Any:
    """The literal structure of one expression, with Raw for what a literal reading cannot give."""
    text = strip_comments(text).strip()
    if not text:
        raise HclReadError("empty expression")
    if text in ("true", "false"):
        return text == "true"
    if text == "null":
        return None
    if _NUMBER.match(text):
        return float(text) if any(c in text for c in ".eE") else int(text)
    if text[0] == '"' and _skip_string(text, 0) == len(text):
        body = text[1:-1]
        if "${" in body or "%{" in body:
            return Template(body)
        return body.encode().decode("unicode_escape") if "\\" in body else body
    if text[0] in "[{" and _skip_balanced(text, 0) == len(text):
        inner = text[1:-1]
        if re.match(r"\s*for\s", inner):
            return Raw(text)
        items = _split_items(inner)
        if text[0] == "[":
            return [parse_value(item) for item in items]
        obj = {}
        for item in items:
            kv = _object_key(item)
            if kv is None:
                return Raw(text)
            obj[kv[0]] = parse_value(kv[1])
        return obj
    m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)\(", text)
    if m and _skip_balanced(text, m.end() - 1) == len(text):
        args = _split_items(text[m.end():-1])
        return Call(m.group(1), tuple(parse_value(a) for a in args))
    if _TRAVERSAL.match(text) and "." in text:
        parts = re.findall(r'[A-Za-z_][A-Za-z0-9_-]*|\d+|"[^"]*"', text)
        return Ref(tuple(p.strip('"') for p in parts))
    return Raw(text)


def _line_of(text: str, i: int) -> int:
    return text.count("\n", 0, i) + 1


def _parse_body(text: str, i: int, path: Path, closing: bool) -> tuple[Body, int]:
    body = Body()
    while True:
        while i < len(text) and (text[i].isspace() or _skip_comment(text, i) is not None):
            i = i + 1 if text[i].isspace() else _skip_comment(text, i)
        if i >= len(text):
            if closing:
                raise HclReadError(f"{path}: block not closed")
            return body, i
        if text[i] == "}":
            if not closing:
                raise HclReadError(f"{path}:{_line_of(text, i)}: unexpected '}}'")
            return body, i + 1
        m = _IDENT.match(text, i)
        if not m:
            raise HclReadError(f"{path}:{_line_of(text, i)}: expected a name, found {text[i:i + 20]!r}")
        name, start, i = m.group(0), i, m.end()
        while i < len(text) and text[i] in " \t":
            i += 1
        if text.startswith("=", i) and not text.startswith("==", i):
            j = _scan_expression(text, i + 1, "}")
            expr = text[i + 1:j].strip()
            body.attributes[name] = Attribute(name, expr, parse_value(expr), _line_of(text, start))
            i = j
            continue
        labels = []
        while i < len(text) and text[i] != "{":
            if text[i] == '"':
                j = _skip_string(text, i)
                labels.append(text[i + 1:j - 1])
                i = j
            elif (lm := _IDENT.match(text, i)) is not None:
                labels.append(lm.group(0))
                i = lm.end()
            elif text[i] in " \t":
                i += 1
            else:
                raise HclReadError(f"{path}:{_line_of(text, i)}: expected '=' or '{{' after {name!r}")
        inner, i = _parse_body(text, i + 1, path, closing=True)
        body.blocks.append(Block(name, labels, inner, path, _line_of(text, start)))


def read_file(path: Path) -> Body:
    """The top-level body of one .tf file."""
    text = path.read_text()
    try:
        body, _ = _parse_body(text, 0, path, closing=False)
    except HclReadError as e:
        if str(e).startswith(str(path)):
            raise
        raise HclReadError(f"{path}: {e}") from e
    for block in _walk(body):
        block.path = path
    return body


def read_tfvars(path: Path) -> dict[str, Attribute]:
    """The assignments of a .tfvars file."""
    body = read_file(path)
    if body.blocks:
        raise HclReadError(f"{path}: a tfvars file holds only assignments, found block {body.blocks[0].type!r}")
    return body.attributes


def _walk(body: Body):
    for block in body.blocks:
        yield block
        yield from _walk(block.body)


def _code_chunks(text: str):
    """The code of an expression: outside strings, plus the inside of every ${...} interpolation."""
    i, start = 0, 0
    while i < len(text):
        if text[i] == '"' or (text.startswith("<<", i) and _HEREDOC.match(text, i)):
            yield text[start:i]
            j = _skip_string(text, i) if text[i] == '"' else _skip_heredoc(text, i)
            k = i
            while (k := text.find("${", k, j)) >= 0:
                end = _skip_balanced(text, k + 1)
                yield from _code_chunks(text[k + 2:end - 1])
                k = end
            i = start = j
            continue
        skipped = _skip_comment(text, i)
        if skipped is not None:
            yield text[start:i]
            i = start = skipped
            continue
        i += 1
    yield text[start:]


def references(text: str, root: str) -> set[str]:
    """Names referenced as `root.NAME` in expression code (not in comments or plain string text)."""
    code = " ".join(_code_chunks(text))
    return set(re.findall(rf"(?<![\w.]){root}\.([A-Za-z_][A-Za-z0-9_-]*)", code))
