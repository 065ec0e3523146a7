"""The HTTP front of a deployment with several engine replicas: it reads each request, works out its prompt's
routing key, and sends it on to a replica through a Serve handle, where the prefix-aware router can see it.

Serve's router sees only a handle call's arguments, never an HTTP body streaming through the proxy (Ray Serve
LLM puts an ingress deployment in front of its engines for the same reason). For each HTTP request the
`IngressApp`:
1. reads the body (at most max_request_body_bytes + 1 bytes: past the limit the replica answers 413);
2. for POST /v1/completions and /v1/chat/completions with the right key, renders the prompt's token ids as
   the replica will (app/prompts.py) and hashes its full blocks as the engine's prefix cache does
   (app/routing/block_hashes.py). A body that does not parse gets no hashes: the replica answers its 400;
3. calls the engine deployment with `RoutedRequest(block_hashes, request_id)` and the request whole
   (app/forwarding.py); the replica's own HTTP app answers it, and the ingress relays every message;
4. re-sends a request whose replica was lost before it answered (its process died, or its engine died and
   it answered 503 engine_dead) to another replica (the router ranks the replicas that lost it last), up to
   MAX_ATTEMPTS calls in all. Once a response has
   started, a lost replica ends it: a stream with OpenAI's in-band error event and [DONE];
5. with tracing on, makes a SERVER span per request, parent of the replica's spans (its traceparent is
   forwarded), with the router's decision as attributes (`shardserve.routing.reason` and the rest).
GET /metrics is the ingress's own registry (app/observability/routing.py). Everything else (/v1/models,
/health, ...) goes to the least-loaded replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from dataclasses import dataclass

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from app.auth import api_key_matches
from app.errors import RETRY_AFTER_S, error_response
from app.forwarding import ForwardedRequest, app_path, read_body
from app.observability.routing import IngressMetrics
from app.observability.tracing import extract_context
from app.prompts import chat_prompt, completion_prompts
from app.protocol import ChatCompletionRequest, CompletionRequest
from app.routing.block_hashes import prompt_block_hashes
from app.routing.request import RoutedRequest
from app.routing.telemetry import RoutingTelemetry
from app.sse import header, is_event_stream, replica_lost_ending, replica_lost_error

logger = logging.getLogger("shardserve.ingress")

MAX_ATTEMPTS = 3  # calls per request: the first, and re-sends after its replica was lost before answering
RETRYABLE_ERROR_CODES = frozenset({"engine_dead"})  # a replica's 503 that another replica would not give
PROMPT_ROUTES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}

# (routed, request) -> the replica's ASGI messages; leaving the iterator early cancels the call
CallReplica = Callable[[RoutedRequest, ForwardedRequest], AsyncIterator[Message]]
LOST_REPLICA_ERRORS = (RayActorError, ReplicaUnavailableError)


@dataclass
class IngressSettings:
    """What the ingress needs of the ServeArgs."""

    block_size: int
    max_request_body_bytes: int
    api_key: str | None


class ReplicaCall:
    """CallReplica over a Serve handle to `LLMServer.answer_http` with stream=True."""

    def __init__(self, handle):
        self.handle = handle

    async def __call__(self, routed: RoutedRequest, request: ForwardedRequest) -> AsyncIterator[Message]:
        stream = self.handle.remote(routed, request)
        finished = False
        try:
            async for message in stream:
                yield message
            finished = True
        finally:
            if not finished:  # the client left, or the ingress gave up on this call: the replica stops too
                stream.cancel()


class ReplicaLost(Exception):
    """The replica holding a request went away (or its engine died) before the response started."""


class IngressApp:
    """The ingress's ASGI app (see the module docstring); `call_replica` is the engine deployment's handle."""

    def __init__(self, call_replica: CallReplica, tokenizer, settings: IngressSettings,
                 telemetry: RoutingTelemetry, metrics: IngressMetrics, tracer: trace.Tracer | None = None):
        self.call_replica = call_replica
        self.tokenizer = tokenizer
        self.settings = settings
        self.telemetry = telemetry
        self.metrics = metrics
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] != "http":
            return
        elif app_path(scope) == "/metrics" and scope["method"] in ("GET", "HEAD"):
            metrics = Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)
            await metrics(scope, receive, send)
        else:
            await self._relay(scope, receive, send)

    def block_hashes(self, request: ForwardedRequest) -> tuple[bytes, ...]:
        """The prompt's full-block hashes, or () for anything the router should place by load alone."""
        model = PROMPT_ROUTES.get(request.path)
        if model is None or request.method != "POST":
            return ()
        if self.settings.api_key is not None:
            authorization = header(request.headers, b"authorization").decode("latin-1")
            if not api_key_matches(authorization, self.settings.api_key):
                return ()  # no tokenizer work for a caller the replica will turn away
        try:
            body = model.model_validate(json.loads(request.body))
            if isinstance(body, ChatCompletionRequest):
                token_ids = chat_prompt(self.tokenizer, body).token_ids
            else:
                token_ids = completion_prompts(self.tokenizer, body)[0].token_ids  # the first prompt leads
        except Exception:  # noqa: BLE001 - the replica answers a bad body with the right 4xx
            return ()
        return prompt_block_hashes(token_ids, self.settings.block_size)

    async def _relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = header(scope.get("headers", ()), b"content-length")
        too_large = declared.isdigit() and int(declared) > self.settings.max_request_body_bytes
        # a body declared too large is not read: the replica answers 413 from the header
        body = b"" if too_large else await read_body(receive, self.settings.max_request_body_bytes + 1)
        request = ForwardedRequest.from_scope(scope, body)
        routed = RoutedRequest(self.block_hashes(request), request_id=uuid.uuid4().hex)
        span = None
        if self.tracer is not None:
            caller = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers}
            span = self.tracer.start_span(f"{request.method} {request.path}", context=extract_context(caller),
                                          kind=SpanKind.SERVER, attributes={
                                              "http.request.method": request.method, "url.path": request.path,
                                              "shardserve.routing.prompt_blocks": len(routed.block_hashes)})
            trace_headers: dict[str, str] = {}  # the replica's spans become this span's children
            propagate.inject(trace_headers, context=trace.set_span_in_context(span))
            request = ForwardedRequest.from_scope(scope, body, trace_headers)
        status, attempts = None, 0
        answer = asyncio.ensure_future(self._answer(routed, request, send))
        client_left = asyncio.ensure_future(_client_left(receive))
        try:
            await asyncio.wait((answer, client_left), return_when=asyncio.FIRST_COMPLETED)
            if not answer.done():  # the client left: cancelling the call stops the replica's work too
                answer.cancel()
            with suppress(asyncio.CancelledError):
                status, attempts = await answer
        finally:
            for task in (answer, client_left):
                task.cancel()
            decision = self.telemetry.claim(routed.request_id)
            if span is not None:
                _end_span(span, status, attempts, decision)

    async def _answer(self, routed: RoutedRequest, request: ForwardedRequest, send: Send) -> tuple[int, int]:
        """Relay one replica's answer, re-sending while replicas are lost before answering; (status, calls)."""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                return await self._relay_once(routed, request, send), attempt
            except ReplicaLost as lost:
                logger.warning("request %s: %s (call %d of %d)", routed.request_id, lost, attempt, MAX_ATTEMPTS)
                if attempt == MAX_ATTEMPTS:
                    info = replica_lost_error()
                    await _send_error(send, 503, info.message, info.type, info.code)
                    return 503, attempt
                self.metrics.retries.inc()
                lost_at = self.telemetry.claim(routed.request_id)  # the router's decision for the lost call
                if lost_at is not None:  # the next call goes elsewhere while anything else can take it
                    routed = dataclasses.replace(routed, avoid=(*routed.avoid, lost_at.replica))
            except BackPressureError:
                await _send_error(send, 429, "The server is overloaded: every replica's queue is full. Retry later.",
                                  "rate_limit_error", "server_overloaded")
                return 429, attempt
            except DeploymentUnavailableError:
                await _send_error(send, 503, "No replica can take the request now, retry later.",
                                  "service_unavailable_error", "service_unavailable")
                return 503, attempt
        raise AssertionError("unreachable")

    async def _relay_once(self, routed: RoutedRequest, request: ForwardedRequest, send: Send) -> int:
        """One call to a replica, relayed as it comes; ReplicaLost if nothing had been sent to the client yet."""
        start: Message | None = None
        held: list[Message] = []  # a 503 (start and body), held until it is known whether to retry it
        complete = False  # the response's last body message has gone out
        stream = self.call_replica(routed, request)
        try:
            async for message in stream:
                if start is None and message["type"] == "http.response.start":
                    start = message
                    if start["status"] == 503:
                        held.append(message)
                        continue
                elif held:
                    held.append(message)
                    if message.get("more_body", False):
                        continue
                    if _error_code(held) in RETRYABLE_ERROR_CODES:
                        raise ReplicaLost("its engine died")
                    for part in held:
                        await send(part)
                    held, complete = [], True
                    continue
                await send(message)
                complete = message["type"] == "http.response.body" and not message.get("more_body", False)
            for part in held:  # a 503 whose body never came
                await send(part)
        except LOST_REPLICA_ERRORS as e:
            if start is None or held:
                raise ReplicaLost(f"its replica was lost ({type(e).__name__})") from None
            logger.warning("request %s: its replica was lost mid-response (%s)", routed.request_id, type(e).__name__)
            await _end_cut_response(start, complete, send)
        finally:
            await stream.aclose()
        if start is None:  # the replica's app ended without answering
            raise ReplicaLost("its replica answered nothing")
        return start["status"]


async def _client_left(receive: Receive) -> None:
    """Returns once the client has disconnected (its request body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _error_code(messages: list[Message]) -> str | None:
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


async def _send_error(send: Send, status: int, message: str, type_: str, code: str) -> None:
    response = error_response(status, message, type_, code=code, headers={"Retry-After": str(RETRY_AFTER_S)})
    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


async def _end_cut_response(start: Message, complete: bool, send: Send) -> None:
    """A response whose replica was lost after it started: a stream gets the error event and [DONE]."""
    if not complete:
        await send({"type": "http.response.body", "body": replica_lost_ending() if is_event_stream(start) else b""})


def _end_span(span, status: int | None, attempts: int, decision) -> None:
    span.set_attribute("shardserve.routing.attempts", attempts)
    if status is not None:
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
    if decision is not None:
        span.set_attribute("shardserve.routing.reason", decision.reason)
        span.set_attribute("shardserve.routing.replica", decision.replica)
        span.set_attribute("shardserve.routing.matched_blocks", decision.matched_blocks)
        span.set_attribute("shardserve.routing.queue_depth", decision.queue_depth)
    span.end()
