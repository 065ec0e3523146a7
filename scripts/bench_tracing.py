"""Tracing overhead: throughput at concurrency 50 with spans exported over OTLP/HTTP vs tracing off, same run.

One replica server (the replica's HTTP app from app/deployment.py build_replica_app, tracing to an OTLP/HTTP
receiver in this process that decodes every export) runs under uvicorn in a subprocess on 127.0.0.1. Rounds alternate
tracing off and on (off, on, on, off, off, on, ...) in that same server process, switched by a route only this
script adds, so both modes share the process, the warmed-up engine and the machine's load over time; each round
sends `--requests` non-streamed completions at `--concurrency`. Reported: output tokens/s per round and the
server process's CPU time per request (user + system, from /proc: less sensitive to other load on the machine).

    python -m scripts.bench_tracing                      # the tiny model (worst case: fastest steps)
    python -m scripts.bench_tracing --model DIR --dtype bfloat16 --prompt-tokens 256 --output-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from scripts.ports import free_port

MODEL_NAME = "bench"


# -- the server side (a subprocess) ---------------------------------------------------------------


def serve(args: argparse.Namespace) -> None:
    """One replica's HTTP app on 127.0.0.1:<port>, tracing to --otlp-endpoint if given."""
    import uvicorn

    from app.config import ServeArgs
    from app.deployment import build_replica_app
    from app.observability.replica import ReplicaObservability
    from engine import AsyncLLMEngine, EngineConfig

    engine = AsyncLLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                                         max_num_seqs=args.concurrency))
    settings = ServeArgs(model=args.model, served_model_name=MODEL_NAME, max_waiting_requests=10_000)
    obs = ReplicaObservability(engine, MODEL_NAME, f"bench-{args.port}", 1, args.otlp_endpoint)
    app = build_replica_app(engine, settings, obs)
    tracer = obs.tracer

    @app.post("/bench/tracing/{state}")
    async def set_tracing(state: str) -> dict:
        obs.tracer = tracer if state == "on" else None
        return {"tracing": obs.tracer is not None}

    try:
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    finally:
        obs.shutdown()
        engine.shutdown()


# -- the receiver and the load (this process) -------------------------------------------------------


class OTLPReceiver(ThreadingHTTPServer):
    """OTLP/HTTP trace receiver on 127.0.0.1 that decodes each export and counts its spans."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.num_spans = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                message = ExportTraceServiceRequest()
                message.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.num_spans += sum(len(s.spans) for r in message.resource_spans for s in r.scope_spans)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"


def start_server(args: argparse.Namespace, port: int, otlp_endpoint: str | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "scripts.bench_tracing", "--serve", "--model", args.model, "--dtype", args.dtype,
           "--port", str(port), "--concurrency", str(args.concurrency), "--max-model-len", str(args.max_model_len)]
    if otlp_endpoint:
        cmd += ["--otlp-endpoint", otlp_endpoint]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], env=env)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc): insensitive to other load on the machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def switch_tracing(port: int, mode: str) -> None:
    r = httpx.post(f"http://127.0.0.1:{port}/bench/tracing/{mode}", timeout=10)
    assert r.json()["tracing"] == (mode == "on"), r.text


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server on port {port} did not become healthy in {timeout_s} s")


async def run_round(port: int, args: argparse.Namespace, seed: int) -> tuple[float, int]:
    """(output tokens per second, failed requests) of one round at the given concurrency."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, args.vocab_size) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    tokens, failures = 0, 0

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal tokens, failures
        while not queue.empty():
            prompt = queue.get_nowait()
            r = await client.post("/v1/completions", json={
                "model": MODEL_NAME, "prompt": prompt, "max_tokens": args.output_tokens, "temperature": 0,
                "ignore_eos": True})
            if r.status_code == 200:
                tokens += r.json()["usage"]["completion_tokens"]
            else:
                failures += 1

    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - start
    return tokens / elapsed, failures


def bench(args: argparse.Namespace) -> None:
    model_tmp = None
    if args.model is None:
        from engine.checkpoint.random_model import make_model

        model_tmp = Path(tempfile.mkdtemp(prefix="bench-tracing-"))
        args.model = str(make_model("llama", "tiny", model_tmp))
        args.dtype = "float32"
    from engine.checkpoint.model_config import load_model_config

    args.vocab_size = load_model_config(args.model).vocab_size
    receiver = OTLPReceiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    port = free_port()
    proc = start_server(args, port, receiver.url)
    results: dict[str, list[float]] = {"off": [], "on": []}
    cpu_ms_per_request: dict[str, list[float]] = {"off": [], "on": []}
    try:
        wait_healthy(port, proc)
        for mode in ("on", "off"):  # warm-up, both paths
            switch_tracing(port, mode)
            asyncio.run(run_round(port, args, seed=-1))
        for i in range(args.rounds):
            for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
                switch_tracing(port, mode)
                cpu_before = cpu_seconds(proc.pid)
                throughput, failures = asyncio.run(run_round(port, args, seed=i))
                cpu_ms_per_request[mode].append(1000 * (cpu_seconds(proc.pid) - cpu_before) / args.requests)
                if failures:
                    raise RuntimeError(f"{failures} requests failed in round {i} ({mode})")
                results[mode].append(throughput)
                print(f"round {i} tracing {mode:>3}: {throughput:8.1f} output tokens/s, "
                      f"server CPU {cpu_ms_per_request[mode][-1]:.2f} ms per request", flush=True)
        expected_spans = 4 * args.requests * (args.rounds + 1)  # traced rounds and the traced warm-up
        deadline = time.monotonic() + 30  # the batch exporter sends every 5 s
        while receiver.num_spans < expected_spans and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        receiver.shutdown()
        if model_tmp is not None:
            shutil.rmtree(model_tmp, ignore_errors=True)
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    print(f"\nmodel {args.model} ({args.dtype}), concurrency {args.concurrency}, {args.requests} requests per round "
          f"of {args.prompt_tokens} prompt / {args.output_tokens} output tokens, {args.rounds} rounds per mode")
    cpu_off, cpu_on = statistics.median(cpu_ms_per_request["off"]), statistics.median(cpu_ms_per_request["on"])
    print("| tracing | output tokens/s (median) | per round | server CPU ms per request (median) |")
    print("|---|---|---|---|")
    for label, mode, tput, cpu in (("off", "off", off, cpu_off), ("on, OTLP/HTTP to a local receiver", "on", on, cpu_on)):
        print(f"| {label} | {tput:.1f} | {', '.join(f'{x:.0f}' for x in results[mode])} | {cpu:.2f} |")
    print(f"throughput overhead: {100 * (off - on) / off:+.1f}% (positive = slower with tracing); "
          f"server CPU overhead: {100 * (cpu_on - cpu_off) / cpu_off:+.1f}%; "
          f"spans received: {receiver.num_spans} of {expected_spans} expected")


def micro(args: argparse.Namespace) -> None:
    """CPU time per request of what tracing adds, measured on this thread (insensitive to the machine's load):
    building one request's 4 spans from its stamps, then exporting them over OTLP/HTTP in 512-span batches."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from app.observability.records import RequestRecord
    from app.observability.tracing import TRACER_NAME, RequestTracer

    receiver = OTLPReceiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    # the replica's batching processor, holding every span until force_flush: the timed loop only builds spans
    provider.add_span_processor(BatchSpanProcessor(memory, max_queue_size=8 * args.requests,
                                                   schedule_delay_millis=3_600_000,
                                                   max_export_batch_size=8 * args.requests))
    tracer = RequestTracer(provider.get_tracer(TRACER_NAME), "micro", 1)
    now = time.time()
    records = [RequestRecord(
        request_id=f"cmpl-{i:032x}-0", operation="text_completion", model=MODEL_NAME,
        num_prompt_tokens=args.prompt_tokens, num_output_tokens=args.output_tokens, num_cached_tokens=0,
        max_tokens=args.output_tokens, temperature=0.0, top_p=1.0, finish_reasons=["length"], arrival_time=now,
        first_scheduled_time=now + 0.01, first_token_time=now + 0.05, finished_time=now + 0.5,
        prefill_chunks=[(now + 0.01, args.prompt_tokens, True)], received_time=now - 0.001)
        for i in range(args.requests)]
    start = time.thread_time()
    for record in records:
        tracer.record(record)
    build_ms = 1000 * (time.thread_time() - start) / len(records)
    provider.force_flush()
    spans = memory.get_finished_spans()
    exporter = OTLPSpanExporter(endpoint=receiver.url)
    start = time.thread_time()
    for i in range(0, len(spans), 512):
        exporter.export(spans[i:i + 512])
    export_ms = 1000 * (time.thread_time() - start) / len(records)
    exporter.shutdown()
    provider.shutdown()
    receiver.shutdown()
    assert receiver.num_spans == 4 * len(records), (receiver.num_spans, len(records))
    print(f"per request: build 4 spans {build_ms:.3f} ms CPU, export over OTLP/HTTP {export_ms:.3f} ms CPU, "
          f"total {build_ms + export_ms:.3f} ms ({len(records)} requests, {len(spans)} spans received)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: a fresh tiny Llama)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--requests", type=int, default=100, help="requests per round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per mode")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--micro", action="store_true",
                        help="measure the CPU time tracing adds per request, on one thread, without a server")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--otlp-endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args)
    elif args.micro:
        micro(args)
    else:
        bench(args)


if __name__ == "__main__":
    main()
