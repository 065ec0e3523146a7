"""`shardserve serve --help` and `shardserve bench --help`: every flag says what it does."""

from __future__ import annotations

import argparse
import re

import pytest

from app.cli import build_parser
from app.config import ServeArgs
from bench.run import BenchArgs


def subcommand(*path: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = subparsers.choices[name]
    return parser


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


@pytest.mark.parametrize("command", [("serve",), ("prepare-node",), ("bench",), ("bench", "report")])
def test_every_flag_has_a_help_line_beyond_its_default(command):
    parser = subcommand(*command)
    for action in flags(parser):
        name = action.option_strings[0] if action.option_strings else action.dest
        words = re.sub(r"\(default: [^)]*\)", "", action.help or "").split()
        assert len(words) >= 2, f"shardserve {' '.join(command)} {name} has no help text: {action.help!r}"
    parser.format_help()  # every help string formats (a bare % would raise here)


@pytest.mark.parametrize(("command", "settings"), [("serve", ServeArgs), ("bench", BenchArgs)])
def test_flags_take_their_help_from_the_settings_descriptions(command, settings):
    """configs/serve.yaml's ServeArgs and the CLI describe each setting with one text."""
    helps = {a.dest: a.help for a in flags(subcommand(command))}
    for name, field in settings.model_fields.items():
        assert field.description, f"{settings.__name__}.{name} has no description"
        if name != "progress":  # bench's --no-progress (vLLM's --disable-tqdm) says the negation
            assert helps[name].startswith(field.description.replace("%", "%%")), name
