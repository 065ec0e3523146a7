"""`shardserve bench` where the bench extra is not installed (the server image installs shardserve[serve] only)."""

from __future__ import annotations

import subprocess
import sys

# tqdm stands for any package of the bench extra: None in sys.modules makes its import fail.
WITHOUT_TQDM = """
import sys
sys.modules["tqdm"] = None
from app.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _shardserve_without_tqdm(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_TQDM, *argv], capture_output=True, text=True, timeout=120
    )


def test_bench_without_the_extra_says_which_extra_to_install():
    done = _shardserve_without_tqdm("bench", "--base-url", "http://127.0.0.1:1", "--concurrency", "2")
    assert done.returncode == 1
    assert "pip install 'shardserve[bench]'" in done.stderr
    assert "tqdm" in done.stderr  # and which package is missing


def test_the_server_cli_works_and_lists_bench_without_the_extra():
    done = _shardserve_without_tqdm("--help")
    assert done.returncode == 0, done.stderr
    assert "serve" in done.stdout and "shardserve[bench]" in done.stdout
