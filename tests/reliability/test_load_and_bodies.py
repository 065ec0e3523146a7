"""Chaos under load, through the real path (local Ray Serve on 127.0.0.1, the tiny Llama): an abort storm
at concurrency 100, a client that reads slowly, oversized and malformed bodies, and memory over many
requests. Each ends with the replica back at idle: nothing running or waiting, every KV block free.

Short versions run in `make test`; `make stress` runs the long ones (marked `stress`) and prints figures.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from app.config import ServeArgs

MODEL = "chaos"
PROMPTS = [f"Story number {i}: once upon a time" for i in range(8)]
MAX_TOKENS = 16
MiB = 1 << 20


@pytest.fixture(scope="module")
def chaos_app(serve_cluster, tiny_llama_dir):
    """One replica of the tiny Llama at /chaos (64 sequences, small body limit), its handle and base URL."""
    from ray import serve

    from app.deployment import build_app

    args = ServeArgs(model=str(tiny_llama_dir), served_model_name=MODEL, dtype="float32", max_model_len=512,
                     max_num_seqs=64, max_waiting_requests=1024, max_ongoing_requests=200,
                     max_request_body_bytes=64 * 1024, cpus_per_rank=0.5, num_replicas=1)
    handle = serve.run(build_app(args), name="chaos", route_prefix="/chaos")
    yield handle, serve_cluster.url("/chaos")
    serve.delete("chaos")


def wait_until_idle(handle, timeout_s: float = 60.0) -> dict:
    """Poll the replica's engine until nothing runs or waits and every block is free; its stats then."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = handle.engine_stats.remote().result()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_free_blocks"] == stats[
                "num_total_blocks"]:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"the replica did not return to idle within {timeout_s} s: {stats}")
        time.sleep(0.1)


def completion_body(prompt: str, max_tokens: int = MAX_TOKENS, stream: bool = True) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


async def streamed_text(client: httpx.AsyncClient, prompt: str, cut_after_first_chunk: bool) -> str | None:
    """The streamed completion's text, or None when the client hangs up after the first chunk."""
    text = []
    async with client.stream("POST", "/v1/completions", json=completion_body(prompt)) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "".join(text)
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            text.append(event["choices"][0]["text"])
            if cut_after_first_chunk:
                return None  # leaving the block closes the connection mid-stream
    raise AssertionError("the stream ended without [DONE]")


async def abort_storm(base_url: str, num_complete: int, num_cut: int, concurrency: int) -> tuple[dict, float]:
    """num_complete streams read to the end and num_cut cut after their first chunk, interleaved, at most
    `concurrency` at once. Returns {prompt: set of texts} of the completed ones and the wall time."""
    total = num_complete + num_cut
    cut = [i * num_cut // total != (i + 1) * num_cut // total for i in range(total)]  # spread evenly
    jobs = [(PROMPTS[i % len(PROMPTS)], cut[i]) for i in range(total)]
    gate = asyncio.Semaphore(concurrency)
    texts: dict[str, set[str]] = {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:

        async def one(prompt: str, cut: bool) -> None:
            async with gate:
                text = await streamed_text(client, prompt, cut)
            if text is not None:
                texts.setdefault(prompt, set()).add(text)

        start = time.perf_counter()
        await asyncio.gather(*(one(prompt, cut) for prompt, cut in jobs))
        return texts, time.perf_counter() - start


def check_abort_storm(chaos_app, num_complete: int, num_cut: int, figures: list[str]) -> None:
    handle, base_url = chaos_app
    before = handle.engine_stats.remote().result()
    texts, seconds = asyncio.run(abort_storm(base_url, num_complete, num_cut, concurrency=100))
    # every prompt's greedy text came out the same however the batch around it looked
    assert sorted(texts) == sorted(PROMPTS)
    assert all(len(variants) == 1 for variants in texts.values()), texts
    stats = wait_until_idle(handle)
    metrics = httpx.get(f"{base_url}/metrics", timeout=30).text
    for gauge in ("num_requests_running", "num_requests_waiting"):
        [value] = [line.rsplit(" ", 1)[1] for line in metrics.splitlines() if line.startswith(f"shardserve:{gauge}{{")]
        assert float(value) == 0.0, f"{gauge} = {value} after the storm"
    figures.append(f"{num_complete} streams completed and {num_cut} cut after their first chunk at concurrency "
                   f"100 in {seconds:.1f} s; back to idle, {stats['num_free_blocks']} of "
                   f"{stats['num_total_blocks']} blocks free, {stats['num_steps'] - before['num_steps']} engine "
                   "steps")


def test_an_abort_storm_at_concurrency_100_leaves_the_replica_idle(chaos_app, figures):
    check_abort_storm(chaos_app, num_complete=150, num_cut=60, figures=figures)


@pytest.mark.stress
def test_stress_1000_streams_and_300_aborts_at_concurrency_100(chaos_app, figures):
    check_abort_storm(chaos_app, num_complete=1000, num_cut=300, figures=figures)


def test_a_client_that_stops_reading_holds_no_more_than_its_own_tokens(chaos_app, figures):
    """A stream whose reader stalls does not stall the engine: its tokens are generated and held in the
    replica (at most max_tokens of them), other requests complete meanwhile, and the slow reader later
    gets every token."""
    handle, base_url = chaos_app
    max_tokens = 400
    expected = httpx.post(f"{base_url}/v1/completions", json=completion_body(PROMPTS[0], max_tokens, stream=False),
                          timeout=120).json()["choices"][0]["text"]
    rss_before = handle.process_rss_bytes.remote().result()
    port = int(base_url.split(":")[2].split("/")[0])
    body = json.dumps(completion_body(PROMPTS[0], max_tokens)).encode()
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel buffers little on our side
    slow.connect(("127.0.0.1", port))
    try:
        # HTTP/1.0: the reply is not chunked, so its bytes are the SSE lines themselves
        slow.sendall(b"POST /chaos/v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        # while it reads nothing, other clients are served in full
        others = [httpx.post(f"{base_url}/v1/completions", json=completion_body(p, stream=False), timeout=120)
                  for p in PROMPTS[1:4]]
        assert all(r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length" for r in others)
        stats = wait_until_idle(handle)  # the stalled stream's generation finished too
        rss_held = handle.process_rss_bytes.remote().result() - rss_before
        received = b""
        while chunk := slow.recv(65536):
            received += chunk
    finally:
        slow.close()
    events = [json.loads(line[len(b"data: "):]) for line in received.split(b"\n")
              if line.startswith(b"data: ") and line != b"data: [DONE]"]
    assert b"data: [DONE]" in received
    assert "".join(e["choices"][0]["text"] for e in events) == expected
    assert rss_held < 64 * MiB, f"the replica grew {rss_held / MiB:.1f} MiB holding one stalled stream"
    figures.append(f"stalled reader of {max_tokens} tokens: replica RSS {rss_held / MiB:+.1f} MiB while held, "
                   f"{stats['num_free_blocks']} of {stats['num_total_blocks']} blocks free once generated")


MALFORMED = [
    # (what, raw body, content-type, status)
    ("body over the limit", b'{"model": "chaos", "prompt": "' + b"x" * (256 * 1024) + b'"}', "application/json", 413),
    ("truncated JSON", b'{"model": "chaos", "prompt": ', "application/json", 400),
    ("not UTF-8", b'{"model": "chaos", "prompt": "\xff\xfe\xfa"}', "application/json", 400),
    ("a JSON list", b'[1, 2, 3]', "application/json", 400),
    ("deeply nested", b'{"model": "chaos", "prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", "application/json", 400),
    ("wrong types", b'{"model": "chaos", "prompt": {"a": 1}, "max_tokens": "many"}', "application/json", 400),
    ("empty", b"", "application/json", 400),
    ("form data", b"model=chaos&prompt=hi", "application/x-www-form-urlencoded", 400),
]


@pytest.mark.parametrize(("what", "body", "content_type", "status"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_oversized_and_malformed_bodies_get_openai_errors_and_leave_the_replica_serving(
        chaos_app, what, body, content_type, status):
    handle, base_url = chaos_app
    with httpx.Client(base_url=base_url, timeout=60) as http:
        r = http.post("/v1/completions", content=body, headers={"content-type": content_type})
        assert r.status_code == status, (what, r.text[:300])
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        ok = http.post("/v1/completions", json=completion_body("hi", 2, stream=False))
        assert ok.status_code == 200
    wait_until_idle(handle)


def check_memory_over_requests(chaos_app, num_requests: int, bound_mib: float, figures: list[str]) -> None:
    """num_requests completions (a third streamed, a sixth cut mid-stream) at concurrency 20 after a warm-up:
    the replica's resident memory grows by less than bound_mib."""
    handle, base_url = chaos_app

    async def load(n: int) -> None:
        gate = asyncio.Semaphore(20)
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

            async def one(i: int) -> None:
                prompt = f"{PROMPTS[i % len(PROMPTS)]} {i}"  # distinct prompts: the prefix cache fills up too
                async with gate:
                    if i % 3:
                        r = await client.post("/v1/completions", json=completion_body(prompt, 8, stream=False))
                        assert r.status_code == 200, r.text
                    else:
                        await streamed_text(client, prompt, cut_after_first_chunk=i % 6 == 0)

            await asyncio.gather(*(one(i) for i in range(n)))

    asyncio.run(load(200))  # warm-up: allocator pools, prefix cache, compiled paths
    wait_until_idle(handle)
    rss_before = handle.process_rss_bytes.remote().result()
    start = time.perf_counter()
    asyncio.run(load(num_requests))
    seconds = time.perf_counter() - start
    wait_until_idle(handle)
    growth = handle.process_rss_bytes.remote().result() - rss_before
    figures.append(f"{num_requests} requests in {seconds:.0f} s: replica RSS {rss_before / MiB:.0f} MiB → "
                   f"{(rss_before + growth) / MiB:.0f} MiB ({growth / MiB:+.1f} MiB, bound {bound_mib:.0f} MiB)")
    assert growth < bound_mib * MiB, f"replica RSS grew {growth / MiB:.1f} MiB over {num_requests} requests"


def test_memory_stays_flat_over_600_requests(chaos_app, figures):
    check_memory_over_requests(chaos_app, 600, bound_mib=48, figures=figures)


@pytest.mark.stress
def test_stress_memory_stays_flat_over_5000_requests(chaos_app, figures):
    check_memory_over_requests(chaos_app, 5000, bound_mib=64, figures=figures)
