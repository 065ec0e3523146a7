"""Request tracing: the span tree built from the engine's time stamps, the caller's trace context, OTLP export.

A real AsyncLLMEngine on the tiny Llama behind the replica's FastAPI app (httpx's ASGI transport), with an
in-memory span exporter; one test exports over real OTLP/HTTP to a receiver on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from contextlib import asynccontextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.parser import text_string_to_metric_families

from app.config import ServeArgs
from app.deployment import build_replica_app
from app.observability.replica import ReplicaObservability
from app.observability.tracing import TracingConfigError, make_tracer_provider, tracing_requested
from engine import AsyncLLMEngine, EngineConfig
from tests.app.asgi_stream import StreamingPost

MODEL = "tiny"
REPLICA = "replica-under-test"


@asynccontextmanager
async def observed_replica(model_dir, otlp_traces_endpoint: str | None = None, span_exporter=None, **engine_args):
    """The replica's HTTP app as every replica serves it (app/deployment.py build_replica_app), with tracing into
    `span_exporter`; yields an httpx client of it, its observability, engine and app."""
    engine = AsyncLLMEngine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=256, **engine_args))
    obs = ReplicaObservability(engine, MODEL, REPLICA, 1, otlp_traces_endpoint, span_exporter=span_exporter)
    app = build_replica_app(engine, ServeArgs(model=str(model_dir), served_model_name=MODEL, max_waiting_requests=64),
                            obs)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://replica") as client:
            yield client, obs, engine, app
    finally:
        obs.shutdown()
        engine.shutdown()


def prompt_ids(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


async def complete(client, prompt: list[int], max_tokens: int, headers: dict | None = None) -> dict:
    r = await client.post("/v1/completions", headers=headers, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def finished_spans(obs: ReplicaObservability, exporter: InMemorySpanExporter):
    obs.tracer_provider.force_flush()
    return exporter.get_finished_spans()


def trees(spans) -> dict[str, dict]:
    """{response id: {"server": span, "queue": span, "prefill": span, "decode": span}} with parent links checked."""
    servers = {s.attributes["gen_ai.response.id"]: s for s in spans if s.kind is SpanKind.SERVER}
    out = {}
    for response_id, server in servers.items():
        children = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == server.context.span_id}
        assert all(c.context.trace_id == server.context.trace_id for c in children.values())
        out[response_id] = {"server": server, **children}
    return out


async def test_one_request_gives_a_server_span_with_queue_prefill_and_decode_children(tiny_llama_dir):
    exporter = InMemorySpanExporter()
    async with observed_replica(tiny_llama_dir, span_exporter=exporter) as (client, obs, _, _):
        body = await complete(client, prompt_ids(20, seed=1), max_tokens=7)
        spans = finished_spans(obs, exporter)
    assert len(spans) == 4
    tree = trees(spans)[body["id"]]
    assert set(tree) == {"server", "queue", "prefill", "decode"}
    server, queue, prefill, decode = tree["server"], tree["queue"], tree["prefill"], tree["decode"]
    assert server.name == f"text_completion {MODEL}" and server.parent is None
    a = server.attributes
    assert a["gen_ai.request.model"] == MODEL and a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.usage.input_tokens"] == 20 == body["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == 7 == body["usage"]["completion_tokens"]
    assert a["gen_ai.request.max_tokens"] == 7 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.request.top_p"] == 1.0
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert a["shardserve.replica_id"] == REPLICA and a["shardserve.tensor_parallel_size"] == 1
    assert a["shardserve.num_cached_tokens"] == 0
    ttft_ns = prefill.end_time - queue.start_time
    assert a["gen_ai.server.time_to_first_token"] == pytest.approx(ttft_ns / 1e9, abs=1e-6)
    # monotonic: arrival <= first scheduled <= first token <= finish, children inside the server span
    assert server.start_time <= queue.start_time <= queue.end_time == prefill.start_time
    assert prefill.start_time <= prefill.end_time == decode.start_time <= decode.end_time <= server.end_time
    assert decode.attributes["gen_ai.usage.output_tokens"] == 7
    tpot = decode.attributes["shardserve.time_per_output_token"]
    assert tpot == pytest.approx((decode.end_time - decode.start_time) / 1e9 / 6, abs=1e-6)
    chunks = [e for e in prefill.events if e.name == "prefill_chunk"]
    assert [e.attributes["num_tokens"] for e in chunks] == [20]


async def test_n_choices_sum_their_tokens_and_time_per_token_follows_one_choice(tiny_llama_dir):
    exporter = InMemorySpanExporter()
    async with observed_replica(tiny_llama_dir, span_exporter=exporter) as (client, obs, _, _):
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt_ids(10, seed=7), "n": 2,
                                                       "max_tokens": 5, "seed": 1, "ignore_eos": True})
        assert r.status_code == 200, r.text
        spans = finished_spans(obs, exporter)
    tree = trees(spans)[r.json()["id"]]
    assert tree["server"].attributes["gen_ai.usage.output_tokens"] == 10 == r.json()["usage"]["completion_tokens"]
    assert tuple(tree["server"].attributes["gen_ai.response.finish_reasons"]) == ("length", "length")
    decode = tree["decode"]
    assert decode.attributes["shardserve.time_per_output_token"] == pytest.approx(
        (decode.end_time - decode.start_time) / 1e9 / 4, abs=1e-6)


async def test_a_chat_request_is_named_chat_and_joins_the_callers_trace(tiny_llama_dir):
    exporter = InMemorySpanExporter()
    trace_id, caller_span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{trace_id}-{caller_span_id}-01", "tracestate": "vendor=value"}
    async with observed_replica(tiny_llama_dir, span_exporter=exporter) as (client, obs, _, _):
        r = await client.post("/v1/chat/completions", headers=headers, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        untraced = await complete(client, prompt_ids(8, seed=2), max_tokens=2)
        spans = finished_spans(obs, exporter)
    by_id = trees(spans)
    server = by_id[r.json()["id"]]["server"]
    assert server.name == f"chat {MODEL}"
    assert server.context.trace_id == int(trace_id, 16)
    assert server.parent is not None and server.parent.span_id == int(caller_span_id, 16)
    assert server.parent.is_remote
    assert server.context.trace_state.get("vendor") == "value"
    other = by_id[untraced["id"]]["server"]
    assert other.parent is None and other.context.trace_id != int(trace_id, 16)


async def test_chunked_prefill_gives_one_event_per_chunk(tiny_llama_dir):
    exporter = InMemorySpanExporter()
    async with observed_replica(tiny_llama_dir, span_exporter=exporter, max_num_batched_tokens=16) as (
            client, obs, _, _):
        body = await complete(client, prompt_ids(50, seed=3), max_tokens=3)
        spans = finished_spans(obs, exporter)
    prefill = trees(spans)[body["id"]]["prefill"]
    chunks = [e for e in prefill.events if e.name == "prefill_chunk"]
    assert [e.attributes["num_tokens"] for e in chunks] == [16, 16, 16, 2]
    assert all(e.attributes["shared_with_decode"] is False for e in chunks)
    assert prefill.attributes["shardserve.prefill.num_chunks"] == 4
    times = [e.timestamp for e in chunks]
    assert times == sorted(times) and prefill.start_time <= times[0] and times[-1] <= prefill.end_time


async def test_with_speculative_decoding_the_decode_span_carries_the_acceptance(tiny_llama_looping_dir):
    exporter = InMemorySpanExporter()
    rng = random.Random(59)  # a prompt whose continuation on the looping model falls into a loop
    prompt = [rng.randrange(3, 512) for _ in range(10)]
    async with observed_replica(tiny_llama_looping_dir, span_exporter=exporter,
                                speculative_config={"num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                                    "prompt_lookup_max": 3}) as (client, obs, _, _):
        body = await complete(client, prompt, max_tokens=40)
        spans = finished_spans(obs, exporter)
    decode = trees(spans)[body["id"]]["decode"]
    proposed = decode.attributes["shardserve.spec_decode.proposed_tokens"]
    accepted = decode.attributes["shardserve.spec_decode.accepted_tokens"]
    assert 0 < accepted < proposed
    assert decode.attributes["gen_ai.usage.output_tokens"] == 40


async def test_a_preempted_request_shows_preemption_and_resume_events(tiny_llama_dir):
    exporter = InMemorySpanExporter()
    # 16 blocks of 16 tokens hold 256 slots; six requests of 30-60 prompt tokens + 24 outputs need ~380
    async with observed_replica(tiny_llama_dir, span_exporter=exporter, num_kv_blocks=16) as (
            client, obs, engine, _):
        bodies = await asyncio.gather(*(complete(client, prompt_ids(n, seed=10 + n), max_tokens=24)
                                        for n in (30, 45, 20, 60, 33, 50)))
        assert engine.stats().num_preemptions > 0, "the pool was large enough: nothing was preempted"
        spans = finished_spans(obs, exporter)
    by_id = trees(spans)
    preempted = [by_id[b["id"]] for b in bodies if by_id[b["id"]]["server"].attributes["shardserve.num_preemptions"]]
    assert preempted
    for tree in preempted:
        # a preemption lands on the span of the phase it interrupted: prefill before the first token, else decode
        decode = tree["decode"]
        events = [e for span in (tree["prefill"], decode) for e in span.events]
        names = [e.name for e in events]
        assert names.count("preempted") == tree["server"].attributes["shardserve.num_preemptions"]
        assert names.count("resumed") == names.count("preempted")
        for span in (tree["prefill"], decode):
            assert all(span.start_time <= e.timestamp <= span.end_time for e in span.events)
        preempted_at = min(e.timestamp for e in events if e.name == "preempted")
        resumed_at = min(e.timestamp for e in events if e.name == "resumed")
        assert preempted_at <= resumed_at
        assert decode.attributes["gen_ai.usage.output_tokens"] == 24


async def test_a_client_that_leaves_gives_an_aborted_error_span_and_an_abort_count(tiny_llama_dir):
    exporter = InMemorySpanExporter()
    async with observed_replica(tiny_llama_dir, span_exporter=exporter) as (client, obs, _, app):
        post = StreamingPost(app, "/v1/completions", {"model": MODEL, "prompt": [7, 8, 9], "max_tokens": 200,
                                                      "ignore_eos": True, "stream": True})
        assert await post.status() == 200
        first = json.loads((await post.next_write()).decode().split("\n\n")[0][len("data: "):])
        await post.leave()  # the client disconnects mid-stream
        spans = finished_spans(obs, exporter)
        metrics = (await client.get("/metrics")).text
    server = trees(spans)[first["id"]]["server"]
    assert tuple(server.attributes["gen_ai.response.finish_reasons"]) == ("abort",)
    assert server.status.status_code is StatusCode.ERROR
    assert 1 <= server.attributes["gen_ai.usage.output_tokens"] < 200
    aborted = [s.value for family in text_string_to_metric_families(metrics) for s in family.samples
               if s.name == "shardserve:request_success_total" and s.labels["finished_reason"] == "abort"]
    assert aborted == [1.0]


class OTLPReceiver(ThreadingHTTPServer):
    """A minimal OTLP/HTTP trace receiver on 127.0.0.1: keeps every decoded ExportTraceServiceRequest."""

    def __init__(self):
        self.requests: list[ExportTraceServiceRequest] = []
        self.paths: list[str] = []
        self.content_types: list[str] = []

        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                message = ExportTraceServiceRequest()
                message.ParseFromString(body)
                receiver.requests.append(message)
                receiver.paths.append(self.path)
                receiver.content_types.append(self.headers["Content-Type"])
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"

    def spans(self) -> list:
        return [span for request in self.requests for resource in request.resource_spans
                for scope in resource.scope_spans for span in scope.spans]

    def resource_attributes(self) -> dict:
        return {kv.key: kv.value.string_value for request in self.requests
                for resource in request.resource_spans for kv in resource.resource.attributes}


@pytest.fixture
def otlp_receiver():
    receiver = OTLPReceiver()
    thread = threading.Thread(target=receiver.serve_forever, daemon=True)
    thread.start()
    yield receiver
    receiver.shutdown()
    receiver.server_close()
    thread.join()


async def test_spans_are_exported_over_otlp_http_to_a_receiver(tiny_llama_dir, otlp_receiver):
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    async with observed_replica(tiny_llama_dir, otlp_traces_endpoint=otlp_receiver.url) as (client, obs, _, _):
        assert obs.tracing
        body = await complete(client, prompt_ids(12, seed=4), max_tokens=5,
                              headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"})
        obs.tracer_provider.force_flush()
    assert set(otlp_receiver.paths) == {"/v1/traces"}
    assert set(otlp_receiver.content_types) == {"application/x-protobuf"}
    spans = otlp_receiver.spans()
    assert sorted(s.name for s in spans) == sorted([f"text_completion {MODEL}", "queue", "prefill", "decode"])
    assert {s.trace_id.hex() for s in spans} == {trace_id}
    server = next(s for s in spans if s.name.startswith("text_completion"))
    attributes = {kv.key: kv.value for kv in server.attributes}
    assert attributes["gen_ai.response.id"].string_value == body["id"]
    assert attributes["gen_ai.usage.output_tokens"].int_value == 5
    assert all(s.parent_span_id == server.span_id for s in spans if s is not server)
    assert otlp_receiver.resource_attributes()["shardserve.replica_id"] == REPLICA


def test_tracing_is_off_by_default_and_starts_no_exporter_thread(monkeypatch):
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    threads_before = set(threading.enumerate())
    assert not tracing_requested(None)
    assert make_tracer_provider(None) is None
    assert set(threading.enumerate()) == threads_before
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4318/v1/traces")
    assert tracing_requested(None)
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing_requested("http://127.0.0.1:4318/v1/traces")


def test_through_ray_serve_the_callers_trace_reaches_the_otlp_receiver(serve_cluster, tiny_llama_dir,
                                                                        otlp_receiver):
    """The real path: Serve's proxy, the replica's middleware and exporter, and /metrics under the route prefix."""
    import openai
    from ray import serve

    from app.deployment import build_app
    from tests.app.conftest import API_KEY, SERVED_NAME, tiny_serve_args

    trace_id = "5b8efff798038103d269b633813fc60c"
    args = tiny_serve_args(tiny_llama_dir, otlp_traces_endpoint=otlp_receiver.url)
    serve.run(build_app(args), name="traced", route_prefix="/traced")
    try:
        client = openai.OpenAI(base_url=serve_cluster.url("/traced/v1"), api_key=API_KEY, max_retries=0,
                               default_headers={"traceparent": f"00-{trace_id}-eee19b7ec3c1b174-01"})
        completion = client.completions.create(model=SERVED_NAME, prompt="Once upon a time", max_tokens=6,
                                               temperature=0)
        deadline = time.monotonic() + 60  # the batch exporter sends every 5 s (OTEL_BSP_SCHEDULE_DELAY)
        while len(otlp_receiver.spans()) < 4:
            assert time.monotonic() < deadline, f"the receiver got {len(otlp_receiver.spans())} spans in 60 s"
            time.sleep(0.2)
        metrics = httpx.get(serve_cluster.url("/traced/metrics"), timeout=30)
        ray_series = wait_for_ray_export('ray_shardserve_prompt_tokens_total{', f'replica="{replica_of(metrics.text)}"')
    finally:
        serve.delete("traced")
    spans = {s.name: s for s in otlp_receiver.spans()}
    assert set(spans) == {f"text_completion {SERVED_NAME}", "queue", "prefill", "decode"}
    assert {s.trace_id.hex() for s in spans.values()} == {trace_id}
    server = spans[f"text_completion {SERVED_NAME}"]
    attributes = {kv.key: kv.value for kv in server.attributes}
    assert attributes["gen_ai.response.id"].string_value == completion.id
    assert attributes["gen_ai.usage.input_tokens"].int_value == completion.usage.prompt_tokens
    replica_id = attributes["shardserve.replica_id"].string_value
    assert replica_id not in ("", "local")
    assert metrics.status_code == 200
    parsed = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for family in text_string_to_metric_families(metrics.text) for s in family.samples}
    key = ("shardserve:prompt_tokens_total", (("model_name", SERVED_NAME), ("replica", replica_id)))
    assert parsed[key] == completion.usage.prompt_tokens
    # the same counter through Ray's per-node metrics export (what Prometheus scrapes across replicas)
    assert float(ray_series.rsplit(" ", 1)[1]) == completion.usage.prompt_tokens


def replica_of(metrics_text: str) -> str:
    return next(s.labels["replica"] for family in text_string_to_metric_families(metrics_text)
                for s in family.samples if s.name == "shardserve:prompt_tokens_total")


def wait_for_ray_export(prefix: str, label: str, timeout_s: float = 90) -> str:
    """The first line of this node's Ray metrics export starting with `prefix` and holding `label`."""
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    deadline = time.monotonic() + timeout_s  # replicas copy every 5 s; Ray reports to its agent every ~10 s
    while True:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        lines = [line for line in text.splitlines() if line.startswith(prefix) and label in line]
        if lines:
            return lines[0]
        assert time.monotonic() < deadline, f"{prefix}...{label} not in Ray's metrics export after {timeout_s} s"
        time.sleep(0.5)


@pytest.fixture
def otlp_grpc_receiver():
    """A minimal OTLP/gRPC TraceService on 127.0.0.1 keeping every ExportTraceServiceRequest."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list = []

    class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - the gRPC method's name
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"grpc://127.0.0.1:{port}", received
    server.stop(grace=None)


async def test_spans_are_exported_over_otlp_grpc_for_a_grpc_url(tiny_llama_dir, otlp_grpc_receiver, monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    url, received = otlp_grpc_receiver
    async with observed_replica(tiny_llama_dir, otlp_traces_endpoint=url) as (client, obs, _, _):
        body = await complete(client, prompt_ids(6, seed=5), max_tokens=2)
        obs.tracer_provider.force_flush()
    spans = [span for request in received for resource in request.resource_spans
             for scope in resource.scope_spans for span in scope.spans]
    assert sorted(s.name for s in spans) == sorted([f"text_completion {MODEL}", "queue", "prefill", "decode"])
    server = next(s for s in spans if s.name.startswith("text_completion"))
    assert {kv.key: kv.value.string_value for kv in server.attributes}["gen_ai.response.id"] == body["id"]


async def test_console_prints_each_span(tiny_llama_dir, capsys):
    async with observed_replica(tiny_llama_dir, otlp_traces_endpoint="console") as (client, obs, _, _):
        body = await complete(client, prompt_ids(6, seed=6), max_tokens=2)
        obs.tracer_provider.force_flush()
    out = capsys.readouterr().out
    for name in (f"text_completion {MODEL}", "queue", "prefill", "decode"):
        assert f'"name": "{name}"' in out
    assert body["id"] in out


def test_an_endpoint_without_a_known_scheme_is_rejected():
    with pytest.raises(TracingConfigError, match="must be `console`"):
        make_tracer_provider("collector:4318")
