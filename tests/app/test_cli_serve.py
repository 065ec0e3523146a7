"""`shardserve serve` end to end: a real process, its own local Ray, loopback only, clean exit on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.app.conftest import free_port
from tests.app.test_serve_scaling import _listening_sockets_of_process_tree


@pytest.mark.slow
def test_serve_command_binds_loopback_serves_and_stops_on_sigterm(tiny_llama_dir, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}  # the CLI sets it
    command = [sys.executable, "-m", "app.cli", "serve", "--model", str(tiny_llama_dir), "--port", str(port),
               "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "256",
               "--cpus-per-rank", "0.5", "--max-num-seqs", "8"]
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy:\n" + log.read_text()[-3000:]
            time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        sockets = _listening_sockets_of_process_tree(server.pid)
        assert any(p == port for _, _, p in sockets)
        assert {addr for _, addr, _ in sockets} == {"127.0.0.1"}, sockets
        assert f"binding HTTP to 127.0.0.1:{port} (this machine only)" in log.read_text()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=90) == 0, log.read_text()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
