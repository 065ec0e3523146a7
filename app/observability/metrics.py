"""Prometheus metrics of one replica, named like vLLM's (`shardserve:` for `vllm:`), served at /metrics.

Request counters and histograms are recorded when a request ends (app/observability/replica.py hands over its
RequestRecord, app/observability/records.py). Engine gauges and counters (queue depth, KV usage, preemptions,
prefix cache, tokens per step) are read from the engine at scrape time, so an idle replica reports 0 running and
0 waiting. Each replica owns its CollectorRegistry: two apps in one process never share series.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from app.observability.records import RequestRecord

logger = logging.getLogger("shardserve.metrics")

PREFIX = "shardserve:"
LABELS = ("model_name", "replica")

# vLLM's buckets, so dashboards and alerts carry over
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# speculative decoding, when it is on (vLLM's names): verifications, proposed, accepted and emitted tokens
SPEC_DECODE_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                        "spec_decode_num_emitted_tokens")

# Every metric name this module exports (the Grafana dashboard's test checks its queries against these).
GAUGES = ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc")
COUNTERS = ("num_preemptions", "prompt_tokens", "generation_tokens", "request_success", "prefix_cache_queries",
            "prefix_cache_hits", *SPEC_DECODE_COUNTERS)
HISTOGRAMS = ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
              "iteration_tokens_total", "spec_decode_acceptance_length")


def exported_series_names() -> set[str]:
    """The sample names /metrics can show (counters with _total, histograms with _bucket/_sum/_count)."""
    names = {PREFIX + g for g in GAUGES} | {f"{PREFIX}{c}_total" for c in COUNTERS}
    for h in HISTOGRAMS:
        names |= {f"{PREFIX}{h}{suffix}" for suffix in ("_bucket", "_sum", "_count")}
    return names


class EngineCollector(Collector):
    """Reads the engine's stats at scrape time: gauges, engine-side counters, and the tokens-per-step histogram."""

    def __init__(self, engine, model_name: str, replica: str):
        self.engine = engine
        self.labels = [model_name, replica]
        # the tokens-per-step histogram accumulates here from the engine's bounded list of recent steps
        # (a scrape interval longer than that list, 4096 steps, loses the oldest of them)
        self._step_buckets = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self._step_sum = 0
        self._step_count = 0
        self._steps_seen = 0
        self._steps_source = None  # the engine's list of recent steps that _steps_seen counts in
        self._lock = threading.Lock()  # /metrics and the Ray mirror thread may collect at once

    def describe(self):
        return []  # names come from collect(); nothing to check at registration

    def collect(self) -> Iterator:
        stats = self.engine.stats()
        yield self._gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield self._gauge("num_requests_swapped", "Requests swapped out to host memory.", stats.num_swapped)
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
                          stats.kv_cache_usage)
        yield self._counter("num_preemptions", "Preemptions since start.", stats.num_preemptions)
        yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            getattr(stats, "prefix_cache_queries", 0))
        yield self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                            getattr(stats, "prefix_cache_hits", 0))
        if getattr(stats, "speculation", None) is not None:
            yield from self._speculation(stats.speculation)
        with self._lock:
            yield self._iteration_tokens()

    def _speculation(self, spec) -> Iterator:
        """Speculative decoding's counters, and how many proposals each verification accepted (0..k)."""
        yield self._counter("spec_decode_num_drafts", "Sequence-steps that verified proposed tokens.",
                            spec.num_verifications)
        yield self._counter("spec_decode_num_draft_tokens", "Proposed tokens.", spec.num_proposed_tokens)
        yield self._counter("spec_decode_num_accepted_tokens", "Proposed tokens the target model accepted.",
                            spec.num_accepted_tokens)
        yield self._counter("spec_decode_num_emitted_tokens", "Tokens emitted by verifying steps.",
                            spec.num_emitted_tokens)
        cumulative, buckets = 0, []
        for length, count in enumerate(spec.acceptance_length_counts):
            cumulative += count
            buckets.append((str(length), cumulative))
        buckets.append(("+Inf", cumulative))
        total = sum(length * count for length, count in enumerate(spec.acceptance_length_counts))
        family = HistogramMetricFamily(PREFIX + "spec_decode_acceptance_length",
                                       "Proposals accepted per verification.", labels=LABELS)
        family.add_metric(self.labels, buckets, sum_value=total)
        yield family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
        family.add_metric(self.labels, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
        family.add_metric(self.labels, value)
        return family

    def _iteration_tokens(self) -> HistogramMetricFamily:
        steps = getattr(self.engine, "recent_steps", ())  # (step number, tokens), oldest first, bounded
        if steps is not self._steps_source:  # a rebuilt engine (app/engine_recovery.py) numbers its steps anew
            self._steps_source, self._steps_seen = steps, 0
        recent = list(steps)
        for step, num_tokens in recent:
            if step <= self._steps_seen:
                continue
            index = next((i for i, b in enumerate(ITERATION_TOKEN_BUCKETS) if num_tokens <= b),
                         len(ITERATION_TOKEN_BUCKETS))
            self._step_buckets[index] += 1
            self._step_sum += num_tokens
            self._step_count += 1
        if recent:
            self._steps_seen = max(self._steps_seen, recent[-1][0])
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, ITERATION_TOKEN_BUCKETS), "+Inf"), self._step_buckets, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        family = HistogramMetricFamily(PREFIX + "iteration_tokens_total", "Tokens computed per engine step.",
                                       labels=LABELS)
        family.add_metric(self.labels, buckets, sum_value=self._step_sum)
        return family


class ServingMetrics:
    """One replica's Prometheus registry: request metrics recorded per finished request, engine metrics at scrape."""

    def __init__(self, engine, model_name: str, replica: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self.replica = replica
        labels = (model_name, replica)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, LABELS, registry=self.registry).labels(*labels)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, LABELS, registry=self.registry, buckets=buckets).labels(*labels)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                (*LABELS, "finished_reason"), registry=self.registry)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per output token after the first.",
                              TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                    REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish.",
                                     REQUEST_LATENCY_BUCKETS)
        self.registry.register(EngineCollector(engine, model_name, replica))

    def observe_finished(self, r: RequestRecord) -> None:
        """Count one ended request (a request with n choices counts once per choice's finish reason)."""
        self.prompt_tokens.inc(r.num_prompt_tokens)
        self.generation_tokens.inc(r.num_output_tokens)
        for reason in r.finish_reasons:
            self._success.labels(self.model_name, self.replica, reason).inc()
        self.e2e.observe(r.e2e_latency)
        self.queue_time.observe(r.queue_time)
        for histogram, value in ((self.ttft, r.time_to_first_token), (self.tpot, r.time_per_output_token),
                                 (self.prefill_time, r.prefill_time), (self.decode_time, r.decode_time)):
            if value is not None:
                histogram.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RayMetricsMirror:
    """Copies a replica's registry into Ray's metrics every `interval_s`, so one scrape of each Ray node's
    metrics export port sees every replica on it (Serve's router sends GET /metrics to one replica at a time).

    Ray exports them as `ray_shardserve_<name>` (its OpenTelemetry recorder rejects ':' in names; a Prometheus
    relabel rule maps them back to `shardserve:<name>`, see docs/OPERATIONS.md). Every sample, counters and
    histogram buckets included, goes over as a Ray gauge holding the cumulative value: rate() and
    histogram_quantile() work on it unchanged.
    """

    def __init__(self, registry: CollectorRegistry, interval_s: float):
        from ray.util import metrics as ray_metrics

        self.registry = registry
        self.interval_s = interval_s
        self._gauge_type = ray_metrics.Gauge
        self._gauges: dict[str, object] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardserve-ray-metrics", daemon=True)
        self._thread.start()

    def push(self) -> None:
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                name = sample.name.replace(PREFIX, "shardserve_", 1)
                gauge = self._gauges.get(name)
                if gauge is None:
                    gauge = self._gauges[name] = self._gauge_type(
                        name, description=family.documentation, tag_keys=tuple(sorted(sample.labels)))
                gauge.set(sample.value, tags=dict(sample.labels))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.push()
            except Exception:  # noqa: BLE001 - metrics must never take the replica down
                logger.exception("could not copy metrics to Ray")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def install_metrics_route(app: FastAPI, metrics: ServingMetrics) -> None:
    """GET /metrics: this replica's registry in Prometheus text format (no API key, like vLLM's)."""

    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route("/metrics", prometheus_metrics, methods=["GET"], response_class=PlainTextResponse,
                      responses={200: {"description": "This replica's metrics in Prometheus' text format."}})
