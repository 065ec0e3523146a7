"""The load generator's client side: streamed OpenAI requests timed chunk by chunk, sent at a fixed
concurrency or as Poisson arrivals. Only the public OpenAI HTTP API is used, so any compatible server works."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Literal

import httpx
import numpy as np

Endpoint = Literal["completions", "chat"]


@dataclass
class RequestResult:
    """One streamed request as the client saw it; times are seconds from the run's start (perf_counter)."""

    index: int
    scheduled_s: float  # when the arrival process released it
    start_s: float = 0.0  # when it was sent
    end_s: float = 0.0  # when the stream ended ([DONE]) or failed
    ttft_s: float | None = None  # first chunk with generated text, measured from start_s
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each content chunk, from start_s
    text: str = ""
    prompt_tokens: int | None = None  # from the final usage chunk
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if the server reports it
    expected_prompt_tokens: int | None = None
    expected_completion_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def output_tokens(self) -> int:
        """Generated tokens: the server's usage count, else the number of content chunks."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times_s)

    @property
    def inter_token_latencies_s(self) -> list[float]:
        return [b - a for a, b in pairwise(self.chunk_times_s)]

    @property
    def usage_mismatch(self) -> str | None:
        """What the server's usage says differently from what was asked, if anything."""
        if not self.ok:
            return None
        if self.completion_tokens is None or self.prompt_tokens is None:
            return "no usage in the stream"
        problems = []
        if self.expected_prompt_tokens is not None and self.prompt_tokens != self.expected_prompt_tokens:
            problems.append(f"prompt_tokens {self.prompt_tokens} != {self.expected_prompt_tokens}")
        if (
            self.expected_completion_tokens is not None
            and self.completion_tokens != self.expected_completion_tokens
        ):
            problems.append(
                f"completion_tokens {self.completion_tokens} != {self.expected_completion_tokens}"
            )
        return "; ".join(problems) or None


@dataclass(frozen=True)
class RequestSpec:
    """What to send for one request."""

    prompt: str
    max_tokens: int
    expected_prompt_tokens: int | None = None


class OpenAIStreamClient:
    """Sends streamed /v1/completions or /v1/chat/completions requests and times every chunk."""

    def __init__(
        self,
        base_url: str,
        model: str,
        endpoint: Endpoint = "completions",
        api_key: str | None = None,
        temperature: float | None = None,
        ignore_eos: bool = True,
        extra_body: dict | None = None,
        timeout_s: float | None = 600.0,
        max_connections: int = 100,
    ):
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self.endpoint = endpoint
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.extra_body = extra_body or {}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    def request_body(self, spec: RequestSpec) -> dict:
        body: dict = {
            "model": self.model,
            "max_tokens": spec.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.temperature is not None:  # else the server's default, as vLLM's client leaves it
            body["temperature"] = self.temperature
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension, also accepted by shardserve, LMDeploy and SGLang
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        return {**body, **self.extra_body}  # vllm bench serve merges its --extra-body last too

    async def send(
        self, spec: RequestSpec, record: RequestResult, clock: Callable[[], float]
    ) -> RequestResult:
        """Stream one request into `record`; failures are written to record.error, never raised."""
        path = "/chat/completions" if self.endpoint == "chat" else "/completions"
        record.expected_prompt_tokens = spec.expected_prompt_tokens
        record.expected_completion_tokens = spec.max_tokens if self.ignore_eos else None
        record.start_s = clock()
        try:
            async with self.http.stream("POST", path, json=self.request_body(spec)) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode("utf-8", "replace")
                    record.error = f"HTTP {response.status_code}: {error_message(body)}"
                else:
                    await self._read_stream(response, record, clock)
        except httpx.HTTPError as exc:
            record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        record.end_s = clock()
        if record.ok and record.ttft_s is None:
            record.error = "stream finished without any generated text"
        return record

    async def _read_stream(self, response: httpx.Response, record: RequestResult, clock: Callable[[], float]):
        saw_done = False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators and ": keep-alive" comments
            payload = line[len("data:") :].strip()
            if payload == "[DONE]":
                saw_done = True
                break
            now = clock()
            try:
                chunk = json.loads(payload)
            except json.JSONDecodeError:
                chunk = None
            if not isinstance(chunk, dict):
                record.error = f"malformed SSE data: {payload[:80]!r}"
                return
            if chunk.get("error"):
                record.error = f"error event: {error_message(json.dumps(chunk))}"
                return
            if usage := chunk.get("usage"):
                record.prompt_tokens = usage.get("prompt_tokens")
                record.completion_tokens = usage.get("completion_tokens")
                record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            for choice in chunk.get("choices") or []:
                text = (
                    (choice.get("delta") or {}).get("content")
                    if self.endpoint == "chat"
                    else choice.get("text")
                )
                if text:
                    if record.ttft_s is None:
                        record.ttft_s = now - record.start_s
                    record.chunk_times_s.append(now - record.start_s)
                    record.text += text
        if not saw_done:
            record.error = "stream ended without data: [DONE]"


def normalize_base_url(base_url: str) -> str:
    """`http://host:port`, `.../v1` or `.../v1/` all mean the server's /v1 API root."""
    url = base_url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def error_message(body: str) -> str:
    """The human part of an OpenAI-shaped error body ({"error": {"message": ...}}), else the body itself."""
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()[:200] or "(empty body)"
    error = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)[:200]
    return str(error)[:200]


async def first_model_id(base_url: str, api_key: str | None = None) -> tuple[str, str | None]:
    """The first model the server lists at GET /v1/models, and its `root` (vLLM puts the local path there)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=normalize_base_url(base_url), headers=headers, timeout=30) as http:
        response = await http.get("/models")
        response.raise_for_status()
        models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url} lists no models at /v1/models; pass --model")
    return models[0]["id"], models[0].get("root")


def poisson_arrival_offsets(num_requests: int, request_rate: float, seed: int) -> np.ndarray:
    """Seconds from the run's start at which each request arrives: exponential gaps of mean 1/rate."""
    if request_rate == float("inf"):
        return np.zeros(num_requests)
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=num_requests)  # [num_requests]
    gaps[0] = 0.0  # the first request opens the run
    return np.cumsum(gaps)


async def run_load(
    client: OpenAIStreamClient,
    specs: Sequence[RequestSpec],
    max_concurrency: int | None,
    request_rate: float | None = None,
    seed: int = 0,
    on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every spec, at most `max_concurrency` in flight, released at Poisson times when a rate is given.

    Returns the records in spec order and the wall time from the first send to the last response.
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    offsets = (
        poisson_arrival_offsets(len(specs), request_rate, seed) if request_rate else np.zeros(len(specs))
    )
    limit = asyncio.Semaphore(max_concurrency or len(specs) or 1)
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    async def one(index: int, spec: RequestSpec) -> RequestResult:
        record = RequestResult(index=index, scheduled_s=float(offsets[index]))
        delay = record.scheduled_s - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        async with limit:
            await client.send(spec, record, clock)
        if on_done is not None:
            on_done(record)
        return record

    records = await asyncio.gather(*(one(i, spec) for i, spec in enumerate(specs)))
    first_start = min((r.start_s for r in records), default=0.0)
    last_end = max((r.end_s for r in records), default=0.0)
    return list(records), last_end - first_start
