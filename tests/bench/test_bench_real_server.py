"""`shardserve bench` against a real `shardserve serve` (tiny model, a subprocess on a free 127.0.0.1 port)."""

from __future__ import annotations

import csv
import json
import math
import os
import socket
import sys

import matplotlib.image
import pytest

from bench.run import BenchArgs, run_bench
from scripts.bench_serve import ServerProcess
from scripts.ports import SERVER_PORTS, free_port

PROMPT_TOKENS = 48
OUTPUT_TOKENS = 12


@pytest.fixture(scope="module")
def served(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    server = ServerProcess(
        str(tiny_llama_dir), extra_args=["--dtype", "float32", "--api-key", "sesame"], log_path=str(log)
    )
    with server.start(timeout_s=240):
        yield server
    assert server.process.returncode is not None  # stopped by PID
    with pytest.raises(ProcessLookupError):
        os.killpg(server.process.pid, 0)  # and nothing it started is left running


@pytest.fixture(scope="module")
def speculating(tiny_llama_dir, tmp_path_factory):
    """The tiny model served with n-gram speculative decoding."""
    log = tmp_path_factory.mktemp("serve-spec") / "serve.log"
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    server = ServerProcess(
        str(tiny_llama_dir),
        extra_args=["--dtype", "float32", "--api-key", "sesame", "--speculative-config", json.dumps(speculative)],
        log_path=str(log),
    )
    with server.start(timeout_s=240):
        yield server


def _args(served, tmp_path, **overrides) -> BenchArgs:
    settings = dict(
        base_url=served.base_url,
        api_key="sesame",
        prompt_tokens=PROMPT_TOKENS,
        output_tokens=OUTPUT_TOKENS,
        num_prompts=[3, 8],
        concurrency=[1, 4],
        progress=False,
        csv=str(tmp_path / "runs.csv"),
        plot=str(tmp_path / "runs.png"),
    )
    return BenchArgs(**{**settings, **overrides})


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_bench_against_shardserve_counts_every_token_exactly(served, tmp_path, endpoint):
    result = await run_bench(_args(served, tmp_path, endpoint=endpoint))
    for summary, records in zip(result.summaries, result.records, strict=True):
        assert (summary.failures, summary.usage_mismatches) == (0, 0), summary.errors
        assert [(r.prompt_tokens, r.completion_tokens) for r in records] == [
            (PROMPT_TOKENS, OUTPUT_TOKENS)
        ] * summary.num_prompts
        assert all(0 < r.ttft_s < r.latency_s for r in records)
        assert summary.generated_tokens == summary.num_prompts * OUTPUT_TOKENS
        assert summary.output_throughput == pytest.approx(summary.generated_tokens / summary.wall_s)
    with open(tmp_path / "runs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["concurrency"], r["successes"]) for r in rows] == [("1", "3"), ("4", "8")]
    assert matplotlib.image.imread(tmp_path / "runs.png").shape[:2] == (420, 1100)


async def test_a_wrong_api_key_fails_every_request_against_shardserve(served, tmp_path):
    result = await run_bench(
        _args(
            served,
            tmp_path,
            api_key="wrong",
            model=served.model_dir,
            tokenizer=served.model_dir,
            num_prompts=[4],
            concurrency=[2],
        )
    )
    summary = result.summaries[0]
    assert (summary.successes, summary.failures) == (0, 4)
    assert summary.errors.startswith("4 x HTTP 401")


def _grounded_args(server, tmp_path) -> BenchArgs:
    """Greedy, so the tiny model's output (and so what n-gram lookup finds) does not depend on the run."""
    return _args(server, tmp_path, dataset_name="grounded", endpoint="chat", prompt_tokens=128, output_tokens=24,
                 num_prompts=[4], concurrency=[2], temperature=0.0, csv=None, plot=None)


async def test_bench_prints_the_acceptance_rate_of_a_server_that_speculates(speculating, tmp_path, capsys):
    result = await run_bench(_grounded_args(speculating, tmp_path))
    (summary,), (records,) = result.summaries, result.records
    assert (summary.failures, summary.usage_mismatches) == (0, 0), summary.errors
    assert {(r.prompt_tokens, r.completion_tokens) for r in records} == {(128, 24)}
    assert 0.0 <= summary.spec_acceptance_rate <= 1.0
    assert 1.0 <= summary.spec_acceptance_length <= 1.0 + 3  # at most k proposals accepted per step
    assert "speculative decoding: acceptance rate" in capsys.readouterr().err


async def test_bench_prints_no_acceptance_for_a_server_that_does_not_speculate(served, tmp_path, capsys):
    result = await run_bench(_grounded_args(served, tmp_path))
    (summary,) = result.summaries
    assert (summary.failures, summary.usage_mismatches) == (0, 0), summary.errors
    assert math.isnan(summary.spec_acceptance_rate) and math.isnan(summary.spec_acceptance_length)
    assert "speculative" not in capsys.readouterr().err


HEALTH_SERVER = """
import http.server, os, signal, sys
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}\\n")
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a server that will not stop politely
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Health).serve_forever()
"""


def test_a_server_is_started_once_and_stopped_with_everything_it_started(tmp_path):
    pids = tmp_path / "pids"
    server = ServerProcess("unused", command=[sys.executable, "-c", HEALTH_SERVER, str(pids)], stop_grace_s=1)
    with server.start(timeout_s=60) as started:
        assert started is server
    (pid,) = pids.read_text().split()  # one process, though both start() and `with` were used
    assert int(pid) == server.process.pid
    server.stop()  # idempotent
    with pytest.raises(ProcessLookupError):
        os.killpg(server.process.pid, 0)  # SIGTERM was ignored: the group was killed


def test_servers_take_ports_outside_the_ranges_the_system_and_ray_hand_out():
    """A port from bind(port 0) is one the system hands out again: a Serve replica once found its direct-ingress
    port taken in the seconds before it bound it. ServerProcess draws below Linux's ephemeral range (32768-60999)
    and above Ray's worker ports (10002-19999), a port free when drawn."""
    ports = {ServerProcess("unused").port for _ in range(20)}
    assert all(p in SERVER_PORTS for p in ports) and len(ports) > 1
    with socket.socket() as sock:  # free when drawn: it can be bound
        sock.bind(("127.0.0.1", free_port()))
