"""OpenTelemetry tracing of requests: one SERVER span per request with `queue`, `prefill` and `decode` children.

The engine only stamps times (engine/sequence.py RequestMetrics); this module turns a finished request's stamps
into spans with explicit start and end times, on the replica (rank 0), after the request's last delta. Nothing
runs inside the engine's step loop, and with tracing off no TracerProvider and no exporter thread exist.

Configuration follows OpenTelemetry's environment variables (OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_*,
OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_PROPAGATORS) plus `--otlp-traces-endpoint`:
`http(s)://host:4318/v1/traces` (OTLP/HTTP protobuf), `grpc://host:4317` (OTLP/gRPC), or `console`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from urllib.parse import urlsplit, urlunsplit

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from app.observability.records import RequestRecord

logger = logging.getLogger("shardserve.tracing")

TRACER_NAME = "shardserve"
NS_PER_S = 1_000_000_000


class TracingConfigError(ValueError):
    """The traces endpoint or OTEL_* settings cannot be turned into an exporter."""


# -- spans ------------------------------------------------------------------------------------------


def _ns(t: float) -> int:
    return int(t * NS_PER_S)


class RequestTracer:
    """Builds each finished request's span tree from its RequestRecord, under the caller's trace context."""

    def __init__(self, tracer: trace.Tracer, replica_id: str, tensor_parallel_size: int):
        self.tracer = tracer
        self.replica_id = replica_id
        self.tensor_parallel_size = tensor_parallel_size

    def record(self, r: RequestRecord, end_time: float | None = None) -> None:
        """Emit the SERVER span `<operation> <model>` and its children under `r.trace_context`; `end_time`
        defaults to now."""
        end = max(end_time if end_time is not None else time.time(), r.finished_time)
        start = min(r.received_time or r.arrival_time, r.arrival_time)
        attributes = {
            "gen_ai.operation.name": r.operation,
            "gen_ai.system": "shardserve",
            "gen_ai.request.model": r.model,
            "gen_ai.response.model": r.model,
            "gen_ai.request.temperature": r.temperature,
            "gen_ai.request.top_p": r.top_p,
            "gen_ai.usage.input_tokens": r.num_prompt_tokens,
            "gen_ai.usage.output_tokens": r.num_output_tokens,
            "gen_ai.response.finish_reasons": r.finish_reasons,
            "gen_ai.response.id": r.response_id,
            "shardserve.request_id": r.request_id,
            "shardserve.replica_id": self.replica_id,
            "shardserve.tensor_parallel_size": self.tensor_parallel_size,
            "shardserve.num_cached_tokens": r.num_cached_tokens,
            "shardserve.num_preemptions": len(r.preemptions),
        }
        if r.max_tokens is not None:  # left out by the client: the rest of the context
            attributes["gen_ai.request.max_tokens"] = r.max_tokens
        if r.time_to_first_token is not None:
            attributes["gen_ai.server.time_to_first_token"] = r.time_to_first_token
        server = self.tracer.start_span(f"{r.operation} {r.model}", context=r.trace_context, kind=SpanKind.SERVER,
                                        attributes=attributes, start_time=_ns(start))
        if "abort" in r.finish_reasons:
            server.set_status(Status(StatusCode.ERROR, "aborted before it finished"))
        inside = trace.set_span_in_context(server)
        self._queue(r, inside)
        self._prefill(r, inside)
        self._decode(r, inside)
        server.end(end_time=_ns(end))

    def _queue(self, r: RequestRecord, inside: otel_context.Context) -> None:
        span = self.tracer.start_span("queue", context=inside, start_time=_ns(r.arrival_time))
        span.end(end_time=_ns(r.first_scheduled_time or r.finished_time))

    def _prefill(self, r: RequestRecord, inside: otel_context.Context) -> None:
        if r.first_scheduled_time is None:
            return
        end = r.first_token_time or r.finished_time
        first_chunks = [c for c in r.prefill_chunks if c[0] <= end]
        span = self.tracer.start_span("prefill", context=inside, start_time=_ns(r.first_scheduled_time), attributes={
            "shardserve.prefill.num_chunks": len(first_chunks),
            "shardserve.prefill.num_tokens": sum(c[1] for c in first_chunks),
            "shardserve.num_cached_tokens": r.num_cached_tokens,
        })
        _add_events(span, r, until=end)
        span.end(end_time=_ns(end))

    def _decode(self, r: RequestRecord, inside: otel_context.Context) -> None:
        if r.first_token_time is None:
            return
        attributes = {"gen_ai.usage.output_tokens": r.num_output_tokens}
        if r.time_per_output_token is not None:
            attributes["shardserve.time_per_output_token"] = r.time_per_output_token
        if r.spec_proposed_tokens:  # speculative decoding's acceptance over this request's decode
            attributes["shardserve.spec_decode.proposed_tokens"] = r.spec_proposed_tokens
            attributes["shardserve.spec_decode.accepted_tokens"] = r.spec_accepted_tokens
        span = self.tracer.start_span("decode", context=inside, start_time=_ns(r.first_token_time),
                                      attributes=attributes)
        _add_events(span, r, after=r.first_token_time)
        span.end(end_time=_ns(r.finished_time))


def _add_events(span, r: RequestRecord, after: float = float("-inf"), until: float = float("inf")) -> None:
    """The request's chunk, preemption and resume events that fall in (after, until], in time order.

    A chunk after the first token is the prompt and outputs prefilled again after a recompute preemption.
    """
    events = [(t, "prefill_chunk" if t <= (r.first_token_time or float("inf")) else "recompute_chunk",
               {"num_tokens": num_tokens, "shared_with_decode": shared}) for t, num_tokens, shared in r.prefill_chunks]
    events += [(t, "preempted", {}) for t in r.preemptions] + [(t, "resumed", {}) for t in r.resumes]
    for t, name, attributes in sorted(events, key=lambda e: e[0]):
        if after < t <= until:
            span.add_event(name, attributes, timestamp=_ns(t))


# -- the caller's trace context -----------------------------------------------------------------------


def extract_context(headers: Mapping[str, str]) -> otel_context.Context:
    """The caller's context from W3C `traceparent`/`tracestate` (or OTEL_PROPAGATORS) headers."""
    return propagate.extract(headers)


class TraceContextMiddleware:
    """ASGI middleware: makes the caller's trace context current while its HTTP request is handled."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        token = otel_context.attach(extract_context(headers))
        try:
            await self.app(scope, receive, send)
        finally:
            otel_context.detach(token)


# -- setup ------------------------------------------------------------------------------------------


def _env(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def tracing_requested(endpoint: str | None) -> bool:
    """Whether `endpoint` or the OTEL_* environment asks for traces (off by default)."""
    if (_env("OTEL_SDK_DISABLED") or "").lower() == "true":
        return False
    if endpoint:
        return True
    exporter = (_env("OTEL_TRACES_EXPORTER") or "").lower()
    if exporter:
        return exporter != "none"
    return bool(_env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or _env("OTEL_EXPORTER_OTLP_ENDPOINT"))


def _protocol(endpoint: str | None) -> str:
    explicit = _env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or _env("OTEL_EXPORTER_OTLP_PROTOCOL")
    if explicit:
        if explicit not in ("grpc", "http/protobuf"):
            raise TracingConfigError(f"OTLP protocol {explicit!r} is not supported: use grpc or http/protobuf")
        return explicit
    if endpoint and urlsplit(endpoint).scheme == "grpc":
        return "grpc"
    return "http/protobuf"


def make_span_exporter(endpoint: str | None):
    """The SpanExporter for `endpoint` ("console", an OTLP URL, or None to read OTEL_* variables)."""
    if endpoint == "console" or (endpoint is None and (_env("OTEL_TRACES_EXPORTER") or "") == "console"):
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter(out=sys.stdout)  # today's stdout, not the one bound at import
    if endpoint is not None and urlsplit(endpoint).scheme not in ("http", "https", "grpc"):
        raise TracingConfigError(
            f"otlp_traces_endpoint {endpoint!r} must be `console`, http(s)://host:4318/v1/traces or grpc://host:4317")
    if _protocol(endpoint) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        if endpoint is None:
            return GrpcExporter()
        parts = urlsplit(endpoint)
        secure = parts.scheme == "https"
        target = urlunsplit(("https" if secure else "http", parts.netloc, "", "", ""))
        return GrpcExporter(endpoint=target, insecure=not secure)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=endpoint) if endpoint is not None else HttpExporter()


def make_tracer_provider(endpoint: str | None, resource_attributes: Mapping[str, str | int] | None = None,
                         exporter=None):
    """A TracerProvider with a batching exporter, or None when tracing is off (then no thread is started).

    It is not installed globally: each replica owns its provider, so two apps in one process stay apart.
    """
    if exporter is None and not tracing_requested(endpoint):
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    attributes = dict(resource_attributes or {})
    if _env("OTEL_SERVICE_NAME") is None:
        attributes.setdefault("service.name", "shardserve")
    provider = TracerProvider(resource=Resource.create(attributes))
    if exporter is None:
        exporter = make_span_exporter(endpoint)
        logger.info("tracing requests to %s", endpoint or "the OTEL_* settings")
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    processor = SimpleSpanProcessor if isinstance(exporter, ConsoleSpanExporter) else BatchSpanProcessor
    provider.add_span_processor(processor(exporter))
    return provider

