"""One replica's observability: Prometheus metrics and (when asked for) request traces, fed one RequestRecord per
finished engine request.

app/serving.py calls `record_request` (its `on_request_finished` callback) when a request's final delta reaches
the replica's event loop, or when the client leaves before it. `install` adds GET /metrics and the middleware
that makes the caller's trace context current to the replica's HTTP app (app/deployment.py build_replica_app).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI

from app.observability.metrics import RayMetricsMirror, ServingMetrics, install_metrics_route
from app.observability.records import RequestRecord
from app.observability.tracing import TRACER_NAME, RequestTracer, TraceContextMiddleware, make_tracer_provider

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine


class ReplicaObservability:
    """One replica's Prometheus registry and, with tracing on, its TracerProvider (one each per replica)."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, replica_id: str = "local",
                 tensor_parallel_size: int = 1, otlp_traces_endpoint: str | None = None, span_exporter=None,
                 ray_metrics_interval_s: float | None = None):
        self.tracer_provider = make_tracer_provider(
            otlp_traces_endpoint, {"shardserve.replica_id": replica_id}, exporter=span_exporter)
        self.tracer: RequestTracer | None = None
        if self.tracer_provider is not None:
            self.tracer = RequestTracer(self.tracer_provider.get_tracer(TRACER_NAME), replica_id,
                                        tensor_parallel_size)
        self.metrics = ServingMetrics(engine, model_name, replica_id)
        # inside a Ray Serve replica: also copy the metrics to Ray's per-node export (app/observability/metrics.py)
        self.ray_mirror = None
        if ray_metrics_interval_s is not None:
            self.ray_mirror = RayMetricsMirror(self.metrics.registry, ray_metrics_interval_s)

    @property
    def tracing(self) -> bool:
        return self.tracer_provider is not None

    def record_request(self, record: RequestRecord) -> None:
        """Count one finished engine request and, with tracing on, emit its spans."""
        self.metrics.observe_finished(record)
        if self.tracer is not None:
            self.tracer.record(record)

    def install(self, app: FastAPI) -> FastAPI:
        """Add GET /metrics and, with tracing on, the middleware that reads the caller's `traceparent`."""
        install_metrics_route(app, self.metrics)
        if self.tracing:
            app.add_middleware(TraceContextMiddleware)
        return app

    def shutdown(self) -> None:
        """Stop the Ray mirror and flush and stop the span exporter (threads that exist only when asked for)."""
        if self.ray_mirror is not None:
            self.ray_mirror.stop()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
