"""A free 127.0.0.1 port for a server the benchmarks and tests start."""

from __future__ import annotations

import random
import socket

# Below Linux's ephemeral range (32768-60999, where connect() and bind(port 0) pick theirs) and above Ray's worker
# ports (10002-19999). A port picked with bind(port 0) is one the system hands out again: it was taken by another
# process in the seconds before the server bound it, once in the tests' own servers (make test, 2026-12-03) and once
# in a benchmark's (a Serve replica of tests/bench/test_bench_real_server.py found its direct-ingress port in use,
# 2026-12-06).
SERVER_PORTS = range(20000, 32000)
_RANDOM = random.SystemRandom()  # each process (a pytest-xdist worker, a benchmark) draws its own


def free_port() -> int:
    """A 127.0.0.1 port free now, outside the ranges the system and Ray hand out on their own."""
    for _ in range(200):
        port = _RANDOM.choice(SERVER_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {SERVER_PORTS.start}-{SERVER_PORTS.stop - 1} after 200 draws")
