"""What each replica observes about its requests: a RequestRecord per ended request, handed to tracing and metrics.

`ObservedEngine` wraps the AsyncLLMEngine that app/serving.py drives (same interface). When a request's last
delta reaches the replica's event loop it builds the request's RequestRecord from the engine's time stamps and
hands it to app/metrics.py (Prometheus) and app/tracing.py (spans). `ReplicaObservability` sets both up once
per replica process and adds /metrics and the trace-context middleware to the replica's HTTP app.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from fastapi import FastAPI
from opentelemetry import context as otel_context

from app.metrics import RayMetricsMirror, ServingMetrics, install_metrics_route
from app.tracing import TRACER_NAME, RequestTracer, TraceContextMiddleware, make_tracer_provider

logger = logging.getLogger("shardserve.observability")


# -- what one finished request did ------------------------------------------------------------------


@dataclass
class RequestRecord:
    """One engine request at its end: what was asked, what came out, and the engine's time stamps (time.time())."""

    request_id: str  # the engine's id: "<response id>-<prompt index>"
    operation: str  # "chat" | "text_completion"
    model: str
    num_prompt_tokens: int
    num_output_tokens: int  # over all choices
    num_cached_tokens: int
    max_tokens: int
    temperature: float
    top_p: float
    finish_reasons: list[str]
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float
    prefill_chunks: list[tuple[float, int, bool]] = field(default_factory=list)
    preemptions: list[float] = field(default_factory=list)
    resumes: list[float] = field(default_factory=list)
    received_time: float | None = None  # when the replica's API handed the request to the engine
    longest_choice_tokens: int | None = None  # output tokens of the longest choice (n > 1); None = all of them

    @property
    def response_id(self) -> str:
        return self.request_id.rsplit("-", 1)[0]

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float:
        return (self.first_scheduled_time or self.finished_time) - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return (self.first_token_time or self.finished_time) - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        return None if self.first_token_time is None else self.finished_time - self.first_token_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first (None with fewer than two tokens)."""
        # the request finishes with its longest choice, whose tokens came one per step after the first
        num_tokens = self.longest_choice_tokens or self.num_output_tokens
        if self.first_token_time is None or num_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_tokens - 1)

    @property
    def e2e_latency(self) -> float:
        return self.finished_time - self.arrival_time


def operation_of(request_id: str) -> str:
    """The GenAI operation name from app/serving.py's request ids ("chatcmpl-..." or "cmpl-...")."""
    return "chat" if request_id.startswith("chatcmpl-") else "text_completion"


# -- the hook: an engine whose requests are observed ------------------------------------------------
class ObservedEngine:
    """AsyncLLMEngine's interface around a real engine: each request's RequestRecord goes to the tracer and the
    metrics when its last delta arrives (or when the client leaves), in the replica's event loop."""

    def __init__(self, engine, model_name: str, tracer: RequestTracer | None = None, metrics=None):
        self.engine = engine
        self.model_name = model_name
        self.tracer = tracer
        self.metrics = metrics  # app.metrics.ServingMetrics or anything with observe_finished(record)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    async def generate(self, prompt_token_ids: list[int], sampling_params, request_id: str,
                       prompt: str | None = None):
        received = time.time()
        parent = otel_context.get_current() if self.tracer is not None else None
        stream = self.engine.generate(prompt_token_ids, sampling_params, request_id=request_id, prompt=prompt)
        tokens_per_choice: dict[int, int] = {}
        finish_reasons: dict[int, str] = {}
        last = None
        try:
            async for delta in stream:
                for out in delta.outputs:
                    tokens_per_choice[out.index] = tokens_per_choice.get(out.index, 0) + len(out.token_ids)
                    if out.finish_reason is not None:
                        finish_reasons[out.index] = out.finish_reason
                last = delta
                if delta.finished:
                    self._observe(delta, sampling_params, tokens_per_choice, finish_reasons, received, parent)
                yield delta
        finally:
            await stream.aclose()
            if last is not None and not last.finished:  # the client left: the engine aborted the request
                for i in range(sampling_params.n):
                    finish_reasons.setdefault(i, "abort")
                self._observe(last, sampling_params, tokens_per_choice, finish_reasons, received, parent)

    def _observe(self, final, params, tokens_per_choice: dict[int, int], finish_reasons: dict[int, str], received: float,
                 parent) -> None:
        if self.tracer is None and self.metrics is None:
            return
        try:
            m = final.metrics
            record = RequestRecord(
                request_id=final.request_id, operation=operation_of(final.request_id), model=self.model_name,
                num_prompt_tokens=len(final.prompt_token_ids), num_output_tokens=sum(tokens_per_choice.values()),
                num_cached_tokens=final.num_cached_tokens, max_tokens=params.max_tokens,
                temperature=params.temperature, top_p=params.top_p,
                finish_reasons=[finish_reasons[i] for i in sorted(finish_reasons)],
                arrival_time=m.arrival_time, first_scheduled_time=m.first_scheduled_time,
                first_token_time=m.first_token_time, finished_time=m.finished_time or time.time(),
                prefill_chunks=list(m.prefill_chunks), preemptions=list(m.preemptions), resumes=list(m.resumes),
                received_time=received, longest_choice_tokens=max(tokens_per_choice.values(), default=0),
            )
            if self.metrics is not None:
                self.metrics.observe_finished(record)
            if self.tracer is not None:
                self.tracer.record(record, parent)
        except Exception:  # observability must never fail a request
            logger.exception("could not record request %s", final.request_id)


class ReplicaObservability:
    """One replica's tracer provider (None when tracing is off) and Prometheus metrics, and its observed engine."""

    def __init__(self, engine, model_name: str, replica_id: str, tensor_parallel_size: int,
                 otlp_traces_endpoint: str | None, span_exporter=None, ray_metrics_interval_s: float | None = None):
        self.tracer_provider = make_tracer_provider(
            otlp_traces_endpoint, {"shardserve.replica_id": replica_id}, exporter=span_exporter)
        tracer = None
        if self.tracer_provider is not None:
            tracer = RequestTracer(self.tracer_provider.get_tracer(TRACER_NAME), replica_id, tensor_parallel_size)
        self.metrics = ServingMetrics(engine, model_name, replica_id)
        self.engine = ObservedEngine(engine, model_name, tracer, self.metrics)
        # inside a Ray Serve replica: also copy the metrics to Ray's per-node export (app/metrics.py)
        self.ray_mirror = None
        if ray_metrics_interval_s is not None:
            self.ray_mirror = RayMetricsMirror(self.metrics.registry, ray_metrics_interval_s)

    @property
    def tracing(self) -> bool:
        return self.tracer_provider is not None

    def install(self, app: FastAPI) -> FastAPI:
        """Add GET /metrics and, with tracing on, the middleware that reads the caller's `traceparent`."""
        install_metrics_route(app, self.metrics)
        if self.tracing:
            app.add_middleware(TraceContextMiddleware)
        return app

    def shutdown(self) -> None:
        """Flush and stop the span exporter (its thread exists only with tracing on)."""
        if self.ray_mirror is not None:
            self.ray_mirror.stop()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
