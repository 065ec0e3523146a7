"""Command-line help from settings: a pydantic field's description, and its default.

Shared by `shardserve serve` (app/cli.py) and `shardserve bench`, so both read alike; it lives here because
the bench imports no server code, while the server's CLI may import the bench.
"""

from __future__ import annotations

from pydantic.fields import FieldInfo


def flag_help(field: FieldInfo) -> str:
    """A flag's help line: its settings field's description (configs and the CLI share it), and its default."""
    text = field.description or ""
    if "(default:" not in text:  # a description says itself what an unset value means
        default = field.get_default(call_default_factory=True)
        text += f" (default: {','.join(map(str, default)) if isinstance(default, list) else default})"
    return text.replace("%", "%%")  # argparse formats help with %
