"""The chaos suite's figures: each test may report lines (recovery times, ...) printed at the end of the run."""

from __future__ import annotations

import pytest

FIGURES = pytest.StashKey[list[str]]()


@pytest.fixture
def figures(request) -> list[str]:
    """Append lines here; the run's summary prints them under the test's name (`make stress` reads them)."""
    lines: list[str] = []
    yield lines
    request.config.stash.setdefault(FIGURES, []).extend(f"{request.node.name}: {line}" for line in lines)


def pytest_terminal_summary(terminalreporter, config) -> None:
    lines = config.stash.get(FIGURES, [])
    if lines:
        terminalreporter.section("chaos figures")
        for line in lines:
            terminalreporter.write_line(line)
