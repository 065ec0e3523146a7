"""Prometheus /metrics of one replica: counters and histograms per finished request, gauges read at scrape time,
and the Grafana dashboard's queries only name metrics that /metrics exports."""

from __future__ import annotations

import asyncio
import json
import random
import re
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from app.config import ServeArgs
from app.deployment import build_replica_app
from app.observability.metrics import PREFIX, exported_series_names
from app.observability.replica import ReplicaObservability
from app.observability.routing import routing_series_names
from engine import AsyncLLMEngine, EngineConfig
from tests.app.asgi_stream import StreamingPost

MODEL = "tiny"
API_KEY = "secret"
DASHBOARD = Path(__file__).resolve().parents[2] / "configs" / "grafana" / "shardserve.json"


@asynccontextmanager
async def observed_replica(model_dir, replica: str = "r0", **engine_args):
    engine = AsyncLLMEngine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=256, **engine_args))
    obs = ReplicaObservability(engine, MODEL, replica)
    app = build_replica_app(engine, ServeArgs(model=str(model_dir), served_model_name=MODEL, max_waiting_requests=64,
                                              api_key=API_KEY), obs)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://replica") as client:
            yield client, obs, engine, app
    finally:
        obs.shutdown()
        engine.shutdown()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of a Prometheus text exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(parsed: dict, name: str, **labels) -> float:
    matches = [v for (n, ls), v in parsed.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(matches) == 1, f"{name} {labels}: {len(matches)} series"
    return matches[0]


async def scrape(client) -> dict:
    r = await client.get("/metrics")  # no API key: Prometheus scrapes without one
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return samples(r.text)


async def test_metrics_after_n_requests_count_n_and_their_tokens(tiny_llama_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 9, 14, 20, 7)]
    max_tokens = [3, 6, 2, 8, 5]
    async with observed_replica(tiny_llama_dir, max_num_batched_tokens=32) as (client, _, engine, _):
        fresh = await scrape(client)
        assert not [name for name, _ in fresh if name == PREFIX + "request_success_total"]
        assert value(fresh, PREFIX + "num_requests_running") == 0

        async def complete(prompt, n):
            r = await client.post("/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, json={
                "model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()

        bodies = await asyncio.gather(*(complete(p, n) for p, n in zip(prompts, max_tokens)))
        parsed = await scrape(client)
        num_steps = engine.stats().num_steps

    n = len(prompts)
    labels = {"model_name": MODEL, "replica": "r0"}
    assert value(parsed, PREFIX + "request_success_total", finished_reason="length", **labels) == n
    assert value(parsed, PREFIX + "prompt_tokens_total", **labels) == sum(map(len, prompts))
    assert value(parsed, PREFIX + "generation_tokens_total", **labels) == sum(max_tokens)
    assert sum(b["usage"]["completion_tokens"] for b in bodies) == sum(max_tokens)
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_prefill_time_seconds", "request_decode_time_seconds",
                      "time_per_output_token_seconds"):
        assert value(parsed, f"{PREFIX}{histogram}_count", **labels) == n, histogram
        assert value(parsed, f"{PREFIX}{histogram}_bucket", le="+Inf", **labels) == n, histogram
    assert value(parsed, PREFIX + "e2e_request_latency_seconds_sum", **labels) >= value(
        parsed, PREFIX + "time_to_first_token_seconds_sum", **labels) > 0
    # tokens per step: every engine step is counted once, and together they computed every prompt and output
    # token except each request's last output (sampled, never fed back)
    assert value(parsed, PREFIX + "iteration_tokens_total_count", **labels) == num_steps > 0
    assert value(parsed, PREFIX + "iteration_tokens_total_sum", **labels) == sum(map(len, prompts)) + sum(
        max_tokens) - n
    # idle again: the gauges are read at scrape time
    for gauge in ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc"):
        assert value(parsed, PREFIX + gauge, **labels) == 0, gauge
    assert value(parsed, PREFIX + "num_preemptions_total", **labels) == 0


async def test_gauges_show_work_in_flight_and_return_to_zero(tiny_llama_dir):
    async with observed_replica(tiny_llama_dir) as (client, _, _, app):
        # a stream read write by write: httpx's ASGI transport would only return once the response ended
        post = StreamingPost(app, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 200,
                                                      "temperature": 0, "ignore_eos": True, "stream": True},
                             headers={"Authorization": f"Bearer {API_KEY}"})
        assert await post.status() == 200
        await post.next_write()  # the request is running: its first token came back
        busy = await scrape(client)
        await post.writes()
        idle = await scrape(client)
    assert value(busy, PREFIX + "num_requests_running") == 1
    assert value(busy, PREFIX + "kv_cache_usage_perc") > 0
    assert value(idle, PREFIX + "num_requests_running") == 0
    assert value(idle, PREFIX + "num_requests_waiting") == 0
    assert value(idle, PREFIX + "kv_cache_usage_perc") == 0
    assert value(idle, PREFIX + "request_success_total", finished_reason="length") == 1


async def test_two_replicas_in_one_process_keep_separate_registries(tiny_llama_dir):
    async with observed_replica(tiny_llama_dir, replica="a") as (client_a, _, _, _), \
            observed_replica(tiny_llama_dir, replica="b") as (client_b, _, _, _):
        r = await client_a.post("/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                                json={"model": MODEL, "prompt": [9, 10], "max_tokens": 2})
        assert r.status_code == 200
        a, b = await scrape(client_a), await scrape(client_b)
    assert value(a, PREFIX + "prompt_tokens_total", replica="a") == 2
    assert value(b, PREFIX + "prompt_tokens_total", replica="b") == 0
    assert not [k for k in b if ("replica", "a") in k[1]]


def test_grafana_dashboard_queries_only_name_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_series_names() | routing_series_names()  # the replicas' and the ingress's
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    assert len(panels) >= 6
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("throughput", "time to first token", "time per output token", "queue", "kv cache", "preemption",
                  "replicas", "hit rate by replica", "routing decisions by replica"):
        assert topic in titles, topic
    for panel in panels:
        exprs = [t["expr"] for t in panel["targets"]]
        assert exprs, panel["title"]
        for expr in exprs:
            names = set(re.findall(r"shardserve:[a-zA-Z0-9_:]+", expr))
            assert names, f"{panel['title']}: {expr} names no shardserve metric"
            assert names <= exported, f"{panel['title']}: {sorted(names - exported)} are not exported"
    quantiles = [t["expr"] for p in panels for t in p["targets"] if "histogram_quantile" in t["expr"]]
    assert any("time_to_first_token_seconds_bucket" in e for e in quantiles)
    assert any("time_per_output_token_seconds_bucket" in e for e in quantiles)
