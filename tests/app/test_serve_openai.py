"""The real path: local Ray Serve, HTTP on 127.0.0.1, the `openai` client, the tiny Llama.

Greedy output through the server must equal the in-process LLM's output for the same prompts.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from engine import SamplingParams
from tests.app.conftest import API_KEY, MAX_MODEL_LEN, SERVED_NAME

PROMPTS = ["The quick brown fox", "Once upon a time", "In the beginning", "Hello, my name is"]


@pytest.fixture(scope="module")
def base_url(served_tiny) -> str:
    cluster, _ = served_tiny
    return cluster.url("/v1")


@pytest.fixture
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0)


def offline_texts(llm, prompts, **params) -> list[str]:
    outputs = llm.generate(prompts, SamplingParams(temperature=0, **params))
    return [o.outputs[0].text for o in outputs]


def chat_prompt_ids(llm, content: str) -> list[int]:
    ids = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": content}],
                                                  add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def poll(predicate, timeout_s: float, what: str):
    """Wait for predicate() to return a truthy value, failing after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]


def test_completions_match_the_offline_engine(client, offline_llm):
    expected = offline_texts(offline_llm, PROMPTS, max_tokens=12)
    assert len(set(expected)) == len(expected), "test model outputs should be diverse"
    response = client.completions.create(model=SERVED_NAME, prompt=PROMPTS, max_tokens=12, temperature=0, n=2)
    assert [c.index for c in response.choices] == list(range(2 * len(PROMPTS)))
    assert [c.text for c in response.choices] == [t for t in expected for _ in range(2)]
    prompt_tokens = sum(len(offline_llm.get_tokenizer().encode(p)) for p in PROMPTS)
    completion_tokens = sum(len(o.outputs[0].token_ids) for o in offline_llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12))) * 2
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == completion_tokens
    assert response.usage.total_tokens == prompt_tokens + completion_tokens


def test_streamed_completion_matches_and_ends_with_usage(client, offline_llm):
    [expected] = offline_texts(offline_llm, PROMPTS[:1], max_tokens=16)
    stream = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert "".join(c.choices[0].text for c in chunks[:-1]) == expected
    assert chunks[-2].choices[0].finish_reason == "length"


def test_stop_string_cuts_the_text(client, offline_llm):
    [full] = offline_texts(offline_llm, PROMPTS[1:2], max_tokens=16)
    stop = full[5:8]
    [expected] = offline_texts(offline_llm, PROMPTS[1:2], max_tokens=16, stop=[stop])
    response = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                         stop=[stop])
    assert response.choices[0].text == expected == full[: full.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_completion_logprobs_are_the_engines(client, offline_llm):
    [out] = offline_llm.generate(PROMPTS[2:3], SamplingParams(temperature=0, max_tokens=6, logprobs=3))
    response = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[2], max_tokens=6, temperature=0,
                                         logprobs=3)
    logprobs = response.choices[0].logprobs
    expected = [lp[t] for t, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)]
    assert logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert all(len(top) >= 1 and max(top.values()) >= chosen - 1e-6
               for top, chosen in zip(logprobs.top_logprobs, logprobs.token_logprobs, strict=True))
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_matches_the_offline_engine_streamed_or_not(client, offline_llm):
    ids = chat_prompt_ids(offline_llm, "Tell me a story")
    [out] = offline_llm.generate([ids], SamplingParams(temperature=0, max_tokens=10, logprobs=2))
    expected = out.outputs[0].text
    response = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Tell me a story"}], max_completion_tokens=10,
        temperature=0, n=2, logprobs=True, top_logprobs=2)
    assert [c.message.content for c in response.choices] == [expected, expected]
    assert response.usage.prompt_tokens == len(ids)
    assert response.usage.completion_tokens == 2 * len(out.outputs[0].token_ids)
    content = response.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [lp[t] for t, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)], abs=1e-4)
    assert all(len(c.top_logprobs) == 2 for c in content)

    stream = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=10,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.prompt_tokens == len(ids)


async def test_fifty_concurrent_streams_all_complete_exactly(base_url, offline_llm):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(50)]
    expected = offline_texts(offline_llm, prompts, max_tokens=8)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0)

    async def one(prompt: str) -> str:
        stream = await client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    texts = await asyncio.gather(*(one(p) for p in prompts))
    await client.close()
    assert texts == expected


def test_client_leaving_mid_stream_frees_its_kv_blocks(base_url):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=60) as http:
        idle = http.get("/engine/stats").json()
        assert idle["num_running"] == 0
        body = {"model": SERVED_NAME, "prompt": PROMPTS[0], "max_tokens": MAX_MODEL_LEN - 16,
                "ignore_eos": True, "temperature": 0, "stream": True}
        with http.stream("POST", "/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            busy = http.get("/engine/stats").json()
            assert busy["num_running"] == 1 and busy["num_free_blocks"] < idle["num_free_blocks"]
        # leaving the `with` closes the connection mid-stream

        def back_to_idle() -> bool:
            stats = http.get("/engine/stats").json()
            return stats["num_running"] == 0 and stats["num_free_blocks"] == idle["num_free_blocks"]

        poll(back_to_idle, 30, "the aborted request's blocks to be freed")
        # it was aborted, not run to its end: far fewer engine steps than the tokens it asked for
        assert http.get("/engine/stats").json()["num_steps"] - busy["num_steps"] < body["max_tokens"] // 2


BAD_REQUESTS = [
    # (path, json body or raw bytes, status, error type)
    ("/completions", {"model": SERVED_NAME, "prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "invalid_request_error"),
    ("/completions", {"model": SERVED_NAME, "prompt": "hi", "temperature": -0.5}, 400, "invalid_request_error"),
    ("/completions", {"model": SERVED_NAME, "prompt": "hi", "n": 0}, 400, "invalid_request_error"),
    ("/completions", {"model": SERVED_NAME, "prompt": "hi", "n": 500}, 400, "invalid_request_error"),
    ("/completions", {"model": SERVED_NAME, "prompt": "hi", "logprobs": 50}, 400, "invalid_request_error"),
    ("/completions", {"model": SERVED_NAME, "prompt": ["hi", 3]}, 400, "invalid_request_error"),
    ("/chat/completions", {"model": SERVED_NAME, "messages": []}, 400, "invalid_request_error"),
    ("/chat/completions", {"model": SERVED_NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "invalid_request_error"),
    ("/chat/completions", b'{"model": "tiny", "messages": [', 400, "invalid_request_error"),
    ("/completions", {"model": "gpt-4o", "prompt": "hi"}, 404, "NotFoundError"),
    ("/completions", {"model": SERVED_NAME, "prompt": "x" * 20000}, 413, "invalid_request_error"),
]


@pytest.mark.parametrize(("path", "body", "status", "error_type"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(base_url, path, body, status, error_type):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=60) as http:
        if isinstance(body, bytes):
            r = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = http.post(path, json=body)
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["type"] == error_type
        ok = http.post("/completions", json={"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200


def test_context_overflow_message_says_both_numbers(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SERVED_NAME, prompt="hello there", max_tokens=MAX_MODEL_LEN)
    assert str(MAX_MODEL_LEN) in info.value.message and "maximum context length" in info.value.message


def test_unknown_model_is_openai_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt="hi")
    assert info.value.code == "model_not_found"


def test_missing_or_wrong_api_key_is_401_but_health_is_open(base_url):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
    root = base_url.removesuffix("/v1")
    assert httpx.get(f"{root}/v1/models").status_code == 401
    assert httpx.get(f"{root}/health").status_code == 200
    assert httpx.get(f"{root}/version").json()["version"]


def test_request_ids_are_unique(client):
    ids = {client.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=1).id for _ in range(5)}
    ids |= {client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "x"}],
                                           max_tokens=1).id for _ in range(5)}
    assert len(ids) == 10
    assert sum(i.startswith("cmpl-") for i in ids) == 5 and sum(i.startswith("chatcmpl-") for i in ids) == 5


def test_engine_stats_are_exposed_on_the_deployment(served_tiny):
    _, handle = served_tiny
    stats = handle.engine_stats.remote().result(timeout_s=30)
    assert stats["num_total_blocks"] > 0 and stats["num_free_blocks"] <= stats["num_total_blocks"]
    depth = handle.record_autoscaling_stats.remote().result(timeout_s=30)
    assert depth == {"engine_queue_depth": 0.0}
