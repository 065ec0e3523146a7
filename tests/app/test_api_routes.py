"""The OpenAI routes of a replica's app over a fake engine (no model, no Ray): bodies, SSE framing, usage, the error
table, and each engine request's record."""

from __future__ import annotations

import json

import httpx
import pytest

from app.config import ServeArgs
from app.deployment import build_replica_app
from app.engine_streams import start_generation
from app.observability.records import RequestContext
from app.observability.replica import ReplicaObservability
from app.prompts import Prompt
from engine.config import SamplingParams
from engine.errors import EngineDeadError, InvalidRequestError
from tests.app.fake_engine import FakeEngine, fake_next_token

MODEL = "fake-model"


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(max_model_len=64)


def make_client(engine: FakeEngine, **settings) -> httpx.AsyncClient:
    """The replica's app as every replica serves it (app/deployment.py build_replica_app) over `engine`."""
    app = build_replica_app(engine, ServeArgs(model=MODEL, max_waiting_requests=4, **settings),
                            ReplicaObservability(engine, MODEL))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.fixture
async def client(engine):
    async with make_client(engine, max_request_body_bytes=2048) as c:
        yield c


def expected_text(prompt: str, max_tokens: int) -> str:
    ids = list(prompt.encode())
    return "".join(chr(fake_next_token(ids, pos, 0, greedy=True)) for pos in range(max_tokens))


def sse_events(body: str) -> list[str]:
    assert body.endswith("\n\n")
    frames = body.split("\n\n")[:-1]
    assert all(f.startswith("data: ") for f in frames), frames
    return [f[len("data: "):] for f in frames]


async def test_models_lists_the_served_name(client):
    r = await client.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [MODEL]


async def test_completion_returns_text_and_exact_usage(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 5,
                                                   "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": expected_text("hi", 5), "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_sampling_fields_a_request_leaves_out_take_the_servers_defaults(engine):
    async with make_client(engine, override_generation_config={"temperature": 0.2, "top_p": 0.9}) as c:
        for body in ({}, {"temperature": 0.7}, {"top_p": 1.0, "top_k": 0}):
            r = await c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, **body,
                                                           "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
    assert [(p.temperature, p.top_p, p.top_k) for p in engine.sampling_params] == [
        (0.2, 0.9, -1), (0.7, 0.9, -1), (0.2, 1.0, -1)]


async def test_without_server_defaults_a_request_samples_at_temperature_1(client, engine):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    [params] = engine.sampling_params
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, -1, 0.0)


async def test_list_prompt_gives_n_choices_per_prompt_in_openai_order(client, engine):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": ["ab", "xyz"],
                                                   "max_tokens": 3, "n": 2, "temperature": 0})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [expected_text("ab", 3)] * 2 + [expected_text("xyz", 3)] * 2
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert len(set(engine.request_ids)) == 2


async def test_echo_prefixes_the_prompt(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hey", "max_tokens": 2,
                                                   "echo": True, "temperature": 0})
    assert r.json()["choices"][0]["text"] == "hey" + expected_text("hey", 2)


async def test_completion_logprobs_have_openai_shape(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                                   "logprobs": 2, "temperature": 0})
    logprobs = r.json()["choices"][0]["logprobs"]
    text = expected_text("hi", 3)
    assert logprobs["tokens"] == list(text)
    assert logprobs["token_logprobs"] == [-0.5] * 3
    assert logprobs["text_offset"] == [0, 1, 2]
    assert all(len(top) == 2 and top[tok] == -0.5 for top, tok in zip(logprobs["top_logprobs"], text, strict=True))


async def test_completion_stream_is_openai_sse_ending_with_done(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4,
                                                   "temperature": 0, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text("hi", 4)
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len({c["id"] for c in chunks}) == 1


async def test_include_usage_adds_a_final_chunk_with_empty_choices(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "n": 2,
                                                   "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10,
                                  "prompt_tokens_details": {"cached_tokens": 0}}


async def test_chat_completion_uses_the_chat_template(client, engine):
    messages = [{"role": "user", "content": "yo"}]
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                        "max_completion_tokens": 3, "temperature": 0})
    body = r.json()
    prompt = engine.tokenizer.apply_chat_template(messages)
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected_text(bytes(prompt).decode(), 3)}
    assert body["usage"]["prompt_tokens"] == len(prompt)


async def test_chat_stream_starts_with_the_role_and_carries_logprobs(client):
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "yo"}]}],
        "max_tokens": 3, "stream": True, "logprobs": True, "top_logprobs": 2})
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [lp for c in chunks[1:] for lp in c["choices"][0]["logprobs"]["content"]]
    assert len(content) == 3
    assert all(lp["logprob"] == -0.5 and len(lp["top_logprobs"]) == 2 for lp in content)
    assert content[0]["bytes"] == list(content[0]["token"].encode())


async def test_stop_string_ends_the_choice_with_stop(client):
    text = expected_text("hi", 10)
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 10,
                                                   "temperature": 0, "stop": [text[3]]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == text[: text.index(text[3])]


BAD_REQUESTS = [
    # (body, status, error type, param)
    ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "invalid_request_error", "n"),
    ({"model": MODEL, "prompt": "hi", "n": 1000}, 400, "invalid_request_error", "n"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "invalid_request_error", "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "invalid_request_error", "top_p"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "invalid_request_error", "max_tokens"),
    ({"model": MODEL, "prompt": 5}, 400, "invalid_request_error", "prompt"),
    ({"model": MODEL, "prompt": ""}, 400, "invalid_request_error", "prompt"),
    ({"model": MODEL, "prompt": [300]}, 400, "invalid_request_error", "prompt"),
    ({"prompt": "hi"}, 400, "invalid_request_error", "model"),
    ({"model": "gpt-9", "prompt": "hi"}, 404, "NotFoundError", "model"),
]


@pytest.mark.parametrize(("body", "status", "error_type", "param"), BAD_REQUESTS)
async def test_bad_completion_requests_get_openai_errors(client, body, status, error_type, param):
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == (error_type, param)
    assert error["message"]
    # the server keeps serving afterwards
    ok = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert ok.status_code == 200


async def test_prompt_plus_max_tokens_over_context_names_both_numbers(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 60})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "64" in message and "65" in message and "60" in message


async def test_a_chat_whose_messages_fill_the_context_names_messages(client):
    long = "x" * 80  # the byte tokenizer: over the fake engine's 64-token context
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages" and "maximum context length is 64 tokens" in error["message"]


async def test_without_max_tokens_a_chat_runs_to_the_end_of_the_context(client):
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 40}]})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
    assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_malformed_json_is_400(client):
    r = await client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


async def test_json_nested_deeper_than_the_parser_recurses_is_400_not_500(engine):
    body = b'{"model": "fake-model", "prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    async with make_client(engine, max_request_body_bytes=100_000) as client:
        r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert "nested too deeply" in r.json()["error"]["message"]
        assert (await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
                ).status_code == 200


async def test_body_over_the_limit_is_413(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 4096})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


async def test_full_waiting_queue_is_429_with_retry_after(client, engine):
    engine.stats_now.num_waiting = 4
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1
    engine.stats_now.num_waiting = 0
    assert (await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})).status_code == 200


async def test_health_follows_the_engine_loop(client, engine):
    assert (await client.get("/health")).status_code == 200
    engine.shutdown()
    assert (await client.get("/health")).status_code == 503


async def test_api_key_guards_v1_routes_only(engine):
    async with make_client(engine, api_key="sesame") as c:
        r = await c.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer wrong"})).status_code == 401
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer sesame"})).status_code == 200
        assert (await c.get("/health")).status_code == 200


async def test_token_id_prompts_are_accepted_alone_or_as_a_batch(client):
    one = await client.post("/v1/completions", json={"model": MODEL, "prompt": [104, 105], "max_tokens": 2,
                                                     "temperature": 0})
    assert one.json()["choices"][0]["text"] == expected_text("hi", 2)
    batch = await client.post("/v1/completions", json={"model": MODEL, "prompt": [[104, 105], [120]],
                                                       "max_tokens": 2, "temperature": 0})
    assert [c["text"] for c in batch.json()["choices"]] == [expected_text("hi", 2), expected_text("x", 2)]


@pytest.mark.parametrize(("error", "status", "error_type"), [
    (InvalidRequestError("the engine says no", param="prompt"), 400, "invalid_request_error"),
    (EngineDeadError("loop died"), 503, "service_unavailable_error"),
])
async def test_engine_errors_before_the_first_token_are_http_errors_even_when_streaming(client, engine, error,
                                                                                         status, error_type):
    engine.fail_with = error
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True})
    assert r.status_code == status
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["type"] == error_type


async def test_leaving_a_multi_prompt_stream_early_closes_every_engine_request(engine):
    prompts = [Prompt("a", [97]), Prompt("b", [98]), Prompt("c", [99])]
    params = [SamplingParams(max_tokens=50)] * 3
    records = []
    deltas = await start_generation(engine, "cmpl-test", prompts, params, RequestContext("text_completion", MODEL),
                                    on_finished=records.append)
    seen = set()
    async for index, _ in deltas:
        seen.add(index)
        if len(seen) == 3:
            break
    assert engine.stats().num_running == 3
    await deltas.aclose()
    assert engine.stats().num_running == 0
    assert engine.num_generated_tokens < 3 * 50  # aborted, not run to the end
    assert sorted(engine.request_ids) == ["cmpl-test-0", "cmpl-test-1", "cmpl-test-2"]
    # each engine request left before its end is recorded once, as aborted
    assert sorted((r.request_id, tuple(r.finish_reasons)) for r in records) == [
        ("cmpl-test-0", ("abort",)), ("cmpl-test-1", ("abort",)), ("cmpl-test-2", ("abort",))]


async def test_each_engine_request_is_recorded_when_its_final_delta_arrives(engine):
    prompts = [Prompt("a", [97]), Prompt(None, [98, 99])]
    params = [SamplingParams(max_tokens=3, n=2, temperature=1.0), SamplingParams(max_tokens=5)]
    context = RequestContext("text_completion", MODEL)
    records = []
    deltas = await start_generation(engine, "cmpl-rec", prompts, params, context, on_finished=records.append)
    async for _, delta in deltas:
        recorded = [r.request_id for r in records]
        assert (delta.request_id in recorded) == delta.finished  # by the time its final delta arrives, not before
    by_id = {r.request_id: r for r in records}
    assert len(records) == 2
    first, second = by_id["cmpl-rec-0"], by_id["cmpl-rec-1"]
    assert (first.num_prompt_tokens, first.num_output_tokens, first.longest_choice_tokens) == (1, 6, 3)
    assert first.finish_reasons == ["length", "length"] and second.finish_reasons == ["length"]
    assert (second.num_prompt_tokens, second.num_output_tokens, second.max_tokens) == (2, 5, 5)
    assert {(r.operation, r.model, r.received_time) for r in records} == {
        ("text_completion", MODEL, context.received_time)}


async def test_a_failing_observer_does_not_fail_the_request(engine):
    def broken(record):
        raise RuntimeError("the metrics backend is down")

    deltas = await start_generation(engine, "cmpl-obs", [Prompt("hi", [104, 105])], [SamplingParams(max_tokens=4)],
                                    RequestContext("text_completion", MODEL), on_finished=broken)
    outputs = [delta async for _, delta in deltas]
    assert outputs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outputs) == 4


async def test_completion_logprobs_zero_still_reports_the_sampled_token(client):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                   "logprobs": 0, "temperature": 0})
    logprobs = r.json()["choices"][0]["logprobs"]
    assert logprobs["top_logprobs"] == [{tok: -0.5} for tok in expected_text("hi", 2)]
