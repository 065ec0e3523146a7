"""The published API contract: /openapi.json documents every body, response and error, and the server keeps it.

schemathesis reads the schema from a live server on 127.0.0.1 and nothing else, generates requests that
fit it and requests that do not, and runs every check it has: it fails on a 5xx, a status the schema does
not list, a content type it does not list, a body, SSE event or header that does not match, a request that
breaks the schema but is served (`"echo": 0`, `"top_logprobs": false`), and one that fits it but is refused
for anything but a reason the schema cannot state (see SCHEMA_VALID_REFUSALS). Two servers: a real uvicorn over
the fake engine (many cases, fast), and the tiny model behind Ray Serve (fewer cases, the real path);
and one broken server that the same run must fail on. Last, the answers Ray Serve's proxy gives by
itself (429 when its queue is full) in the same OpenAI error shape.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import uvicorn

from app.config import ServeArgs
from app.deployment import build_replica_app
from app.observability.replica import ReplicaObservability
from app.proxy_errors import PROXY_CALLBACK, PROXY_CALLBACK_ENV, OpenAIErrorsFromServe
from tests.app.conftest import API_KEY, SERVED_NAME, free_port, tiny_serve_args
from tests.app.fake_engine import FakeEngine

MODEL = "fake-model"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
# A body that fits the schema may still be refused, for what a schema cannot say: 400 for a prompt longer
# than the context, a rule across fields (top_logprobs without logprobs, two output constraints), a JSON
# schema, regex or grammar that does not compile, a tool_choice naming a function not in `tools`; 413 for a
# body over --max-request-body-bytes (generated bodies can be large). A body that breaks the schema may be
# refused by its size (413) before it is read.
SCHEMA_VALID_REFUSALS = ["2xx", "400", "401", "404", "413", "429"]
SCHEMA_VIOLATION_ANSWERS = ["400", "401", "404", "405", "413", "429"]
ERROR_STATUSES = {"400", "401", "404", "413", "429", "503"}


# -- the servers and the schema they publish --------------------------------------------------------


@contextmanager
def serving_on_loopback(app) -> Iterator[str]:
    """`app` on a real uvicorn at 127.0.0.1; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def fake_replica_app(engine: FakeEngine, **settings):
    """The replica's app as every replica serves it (app/deployment.py build_replica_app) over a fake engine."""
    return build_replica_app(engine, ServeArgs(model=MODEL, max_waiting_requests=4, **settings),
                             ReplicaObservability(engine, MODEL))


@pytest.fixture(scope="module")
def fake_server() -> Iterator[str]:
    app = fake_replica_app(FakeEngine(max_model_len=256), api_key=API_KEY, max_request_body_bytes=16384)
    with serving_on_loopback(app) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def published(fake_server) -> dict:
    return httpx.get(f"{fake_server}/openapi.json").json()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_generation_routes_publish_their_body_responses_and_every_error(published, path):
    operation = published["paths"][path]["post"]
    request_model = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest"}[path]
    assert operation["requestBody"]["required"]
    assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + request_model)
    ok = operation["responses"]["200"]["content"]
    assert set(ok) == {"application/json", "text/event-stream"}
    assert set(operation["responses"]) == {"200"} | ERROR_STATUSES
    for status in ERROR_STATUSES:
        schema = operation["responses"][status]["content"]["application/json"]["schema"]
        assert schema["$ref"].endswith("/ErrorResponse")
    assert "Retry-After" in operation["responses"]["429"]["headers"]
    assert operation["security"] == [{"bearerAuth": []}]


def test_the_schema_publishes_the_constraint_and_tool_fields(published):
    schemas = published["components"]["schemas"]
    constraints = {"logit_bias", "response_format", "structured_outputs", "guided_json", "guided_regex",
                   "guided_choice", "guided_grammar"}
    assert constraints <= set(schemas["CompletionRequest"]["properties"])
    assert constraints | {"tools", "tool_choice", "parallel_tool_calls"} <= set(
        schemas["ChatCompletionRequest"]["properties"])
    assert {"tool_calls", "tool_call_id"} <= set(schemas["ChatMessage"]["properties"])
    assert "tool_calls" in schemas["AssistantMessage"]["properties"]
    assert "tool_calls" in schemas["DeltaMessage"]["properties"]
    assert schemas["StructuredOutputsRequest"]["additionalProperties"] is False  # an unknown key is a 400
    examples = published["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert {"tool_call", "json_schema"} <= set(examples["examples"])  # sent by the contract run's examples phase


def test_no_route_publishes_a_422_and_every_reference_resolves(published):
    statuses = {s for item in published["paths"].values() for op in item.values() for s in op["responses"]}
    assert "422" not in statuses  # a body that does not validate is a 400, as at OpenAI
    schemas = published["components"]["schemas"]
    error = schemas["ErrorInfo"]
    assert {"message", "type"} <= set(error["required"]) and {"param", "code"} <= set(error["properties"])

    def refs(node):
        if isinstance(node, dict):
            yield from ([node["$ref"]] if "$ref" in node else [])
            for value in node.values():
                yield from refs(value)
        elif isinstance(node, list):
            for value in node:
                yield from refs(value)

    assert {ref.rsplit("/", 1)[-1] for ref in refs(published)} <= set(schemas)
    assert {"/health", "/version", "/metrics", "/v1/models", "/v1/engine/stats"} <= set(published["paths"])
    assert set(published["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}


def test_unknown_paths_and_methods_get_openai_errors(fake_server):
    missing = httpx.get(f"{fake_server}/v1/nothing", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Invalid URL (GET /v1/nothing)"
    wrong_method = httpx.get(f"{fake_server}/v1/completions", headers=AUTH)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "invalid_request_error"
    assert wrong_method.headers["allow"] == "POST"


# -- schemathesis against the published schema ----------------------------------------------------


def run_schemathesis(base_url: str, served_model: str, workdir: Path, *, max_examples: int, phases: str,
                     include_path: str | None = None, hooks: str | None = None) -> subprocess.CompletedProcess:
    """`st run` on the server's /openapi.json: exit status 0 when no check failed.

    The only test data it gets is the served model's name, which the request bodies carry as `model`
    in most generated cases (the rest test the 404 of an unknown model)."""
    config = workdir / "schemathesis.toml"
    config.write_text(f'[dictionaries.served-model]\nvalues = ["{served_model}"]\n\n'
                      f'[checks.positive_data_acceptance]\nexpected-statuses = {json.dumps(SCHEMA_VALID_REFUSALS)}\n\n'
                      f'[checks.negative_data_rejection]\nexpected-statuses = {json.dumps(SCHEMA_VIOLATION_ANSWERS)}\n\n'
                      '[parameters]\n"body.model" = { dictionary = "served-model", probability = 0.75 }\n')
    command = [str(SCHEMATHESIS), "--no-color", "--config-file", str(config), "run", f"{base_url}/openapi.json",
               "--header", f"Authorization: Bearer {API_KEY}", "--checks", "all",
               "--max-examples", str(max_examples), "--phases", phases, "--workers", "1",
               "--request-timeout", "60", "--report", "ndjson", "--report-ndjson-path", str(workdir / "run.ndjson"),
               *(["--include-path", include_path] if include_path else [])]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    if hooks:
        env["SCHEMATHESIS_HOOKS"] = hooks
    # cwd: schemathesis keeps its example database and reports in the working directory
    return subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=240)


def statuses_reached(workdir: Path) -> set[tuple[str, str, int]]:
    """(method, path, status) of every request in a run's NDJSON report."""
    reached = set()

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("request"), dict) and isinstance(node.get("response"), dict):
                path = urlsplit(node["request"]["uri"]).path
                reached.add((node["request"]["method"], path, node["response"]["status_code"]))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for line in (workdir / "run.ndjson").read_text().splitlines():
        walk(json.loads(line))
    return reached


def assert_reached_every_operation_and_the_engine(base_url: str, workdir: Path) -> None:
    """Every published operation was called, and both generation routes both generated (200) and refused (400)."""
    reached = statuses_reached(workdir)
    published = httpx.get(f"{base_url}/openapi.json").json()["paths"]
    called = {(method, path) for method, path, _ in reached}
    assert {(m.upper(), path) for path, item in published.items() for m in item} <= called, sorted(called)
    for path in ("/v1/completions", "/v1/chat/completions"):
        for status in (200, 400):
            assert ("POST", path, status) in reached, (path, status, sorted(reached))


def test_the_replica_app_keeps_its_published_contract(fake_server, tmp_path):
    run = run_schemathesis(fake_server, MODEL, tmp_path, max_examples=40, phases="examples,coverage,fuzzing")
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert_reached_every_operation_and_the_engine(fake_server, tmp_path)


def test_the_served_model_keeps_its_published_contract(served_tiny, tmp_path):
    cluster, _ = served_tiny
    run = run_schemathesis(cluster.url(), SERVED_NAME, tmp_path, max_examples=10, phases="examples,fuzzing",
                           hooks="tests.app.schemathesis_real_model_hooks")
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert_reached_every_operation_and_the_engine(cluster.url(), tmp_path)


class FailingEngine(FakeEngine):
    async def generate(self, prompt_token_ids, sampling_params, request_id, prompt=None):
        raise RuntimeError("the engine broke")
        yield


def test_the_contract_run_fails_on_a_server_error(tmp_path):
    app = fake_replica_app(FailingEngine(max_model_len=256), api_key=API_KEY)
    with serving_on_loopback(app) as base_url:
        run = run_schemathesis(base_url, MODEL, tmp_path, max_examples=5, phases="examples",
                               include_path="/v1/completions")
    assert run.returncode != 0 and "Server error" in run.stdout, run.stdout[-3000:]


# -- Serve's own answers --------------------------------------------------------------------------


def test_the_configs_name_the_proxy_callback_that_serve_will_call():
    module, _, function = PROXY_CALLBACK.partition(":")
    [middleware] = getattr(importlib.import_module(module), function)()
    assert middleware.cls is OpenAIErrorsFromServe
    for config in ("configs/serve.yaml", "configs/rayservice.yaml"):
        assert f"{PROXY_CALLBACK_ENV}={PROXY_CALLBACK}" in (REPO_ROOT / config).read_text() or \
            f'{PROXY_CALLBACK_ENV}, value: "{PROXY_CALLBACK}"' in (REPO_ROOT / config).read_text(), config


async def test_serves_plain_text_429_becomes_an_openai_error_with_retry_after():
    from ray.serve._private.http_util import convert_object_to_asgi_messages, retry_after_headers

    async def serve_rejects(scope, receive, send):  # what Serve's proxy sends when its queue is full
        for message in convert_object_to_asgi_messages(
                "Request dropped due to backpressure (num_queued_requests=1, max_queued_requests=1).",
                status_code=429, extra_headers=retry_after_headers(1.0)):
            await send(message)

    transport = httpx.ASGITransport(app=OpenAIErrorsFromServe(serve_rejects))
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        r = await client.post("/v1/completions", json={})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("rate_limit_error", "server_overloaded", None)
    assert "max_queued_requests=1" in error["message"]


async def test_the_apps_own_responses_pass_the_proxy_middleware_untouched():
    app = fake_replica_app(FakeEngine(max_model_len=64))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as direct, \
            httpx.AsyncClient(transport=httpx.ASGITransport(app=OpenAIErrorsFromServe(app)),
                              base_url="http://app") as proxied:
        for method, path, body in [("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                                                 "temperature": 0, "stream": True}),
                                   ("POST", "/v1/completions", {"model": "other", "prompt": "hi"}),
                                   ("GET", "/health", None)]:
            a, b = [await c.request(method, path, json=body) for c in (direct, proxied)]
            assert (a.status_code, a.headers["content-type"], _without_ids(a.content)) == \
                   (b.status_code, b.headers["content-type"], _without_ids(b.content))


def _without_ids(body: bytes) -> bytes:
    return re.sub(rb'"(id|created)":("[^"]*"|\d+)', b"", body)


async def test_serves_own_queue_full_429_reaches_the_client_in_openai_shape(served_tiny):
    """The deployment's real backpressure options on a deployment that holds each request 2 s."""
    from ray import serve

    from app.deployment import deployment_options

    cluster, _ = served_tiny
    options = deployment_options(tiny_serve_args("unused", max_waiting_requests=1, max_ongoing_requests=1))

    @serve.deployment(max_ongoing_requests=1, max_queued_requests=options["max_queued_requests"],
                      backpressure_config=options["backpressure_config"])
    class Busy:
        async def __call__(self, request) -> str:
            await asyncio.sleep(2)
            return "done"

    serve.run(Busy.bind(), name="busy", route_prefix="/busy")
    try:
        async with httpx.AsyncClient(base_url=cluster.url(), timeout=30) as client:
            responses = await asyncio.gather(*(client.post("/busy") for _ in range(4)))
    finally:
        serve.delete("busy")
    rejected = [r for r in responses if r.status_code == 429]
    assert rejected and any(r.status_code == 200 for r in responses), [(r.status_code, r.text) for r in responses]
    for r in rejected:
        assert r.headers["retry-after"] == "1" and r.headers["content-type"] == "application/json"
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "server_overloaded")
        assert "backpressure" in error["message"]
