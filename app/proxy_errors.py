"""OpenAI's error shape for the answers that Ray Serve's HTTP proxy gives by itself.

Some requests never reach a replica: when the router's queue is full (`max_queued_requests`), Serve
answers 429 with Retry-After (`backpressure_config`), and with no replica to take a request it answers
503. Serve 2.60 writes these bodies as plain text (ray/serve/_private/http_util.py:
`get_http_response_status` and `send_http_response_on_exception`), and `backpressure_config` sets
only the status and Retry-After. What the proxy does offer is a list of ASGI middlewares around it,
named by the environment variable RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH in the proxy's process
(ray/serve/_private/http_util.py `configure_http_middlewares`). This module's middleware rewrites
Serve's plain-text errors into `{"error": {...}}` and passes everything else through untouched.
It also ends what a dead replica left open: when the replica's process dies, Serve's proxy stops without
a word (a response not started becomes its bare 500, a stream is cut without its last chunk), so the
middleware answers OpenAI's 503 with Retry-After, or ends the stream with an error event and [DONE]
as the replica itself does when its engine dies.
The variable must be set before Ray starts, so that the proxy inherits it: `shardserve serve` does
that; with `ray start` / `serve run`, export it first (configs/serve.yaml).
"""

from __future__ import annotations

import os

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import RETRY_AFTER_S
from app.protocol import ErrorInfo, ErrorResponse
from app.sse import header, is_event_stream, replica_lost_ending, replica_lost_error

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "app.proxy_errors:proxy_middlewares"

# status -> (message prefix, OpenAI error type, code); the same type and code as the app's own 429 and 503
SERVE_ERRORS = {
    429: ("The server is overloaded, retry later: ", "rate_limit_error", "server_overloaded"),
    503: ("No replica can take the request now, retry later: ", "service_unavailable_error", "service_unavailable"),
    408: ("The request timed out: ", "timeout_error", "request_timeout"),
}


def use_openai_errors_in_serve_proxy() -> None:
    """Have Serve's proxy load this module's middleware: call before `ray.init` starts a local Ray."""
    os.environ[PROXY_CALLBACK_ENV] = PROXY_CALLBACK


def proxy_middlewares() -> list[Middleware]:
    """The proxy callback: Serve calls it once in each proxy process."""
    return [Middleware(OpenAIErrorsFromServe)]


def openai_error_body(status: int, text: str) -> bytes:
    prefix, type_, code = SERVE_ERRORS.get(status, ("", "server_error" if status >= 500 else
                                                    "invalid_request_error", None))
    body = ErrorResponse(error=ErrorInfo(message=prefix + text.strip(), type=type_, code=code))
    return body.model_dump_json().encode()


class OpenAIErrorsFromServe:
    """ASGI middleware in Serve's proxy: an error status with a text/plain body becomes OpenAI's JSON error.

    The app's own errors are JSON already and pass untouched, as do Serve's own routes (/-/healthz, /-/routes)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith("/-/"):
            await self.app(scope, receive, send)
            return
        held: Message | None = None  # the start of a plain-text error, sent once its body is complete
        text = bytearray()
        started: Message | None = None  # the response's start, as the app sent it
        complete = False  # its last body message has gone out

        async def send_openai_errors(message: Message) -> None:
            nonlocal held, started, complete
            if message["type"] == "http.response.start":
                started = message
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            if message["type"] == "http.response.start" and _is_plain_text_error(message):
                held = message
                return
            if held is None or message["type"] != "http.response.body":
                await send(message)
                return
            text.extend(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = openai_error_body(held["status"], text.decode("utf-8", errors="replace"))
            headers = [(k, v) for k, v in held.get("headers", [])
                       if bytes(k).lower() not in (b"content-type", b"content-length")]
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({**held, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, send_openai_errors)
        if started is None:  # the replica died before answering (a client that left gets nothing either way)
            body = ErrorResponse(error=replica_lost_error()).model_dump_json().encode()
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(RETRY_AFTER_S).encode())]})
            await send({"type": "http.response.body", "body": body})
        elif not complete and is_event_stream(started):
            await send({"type": "http.response.body", "body": replica_lost_ending()})


def _is_plain_text_error(start: Message) -> bool:
    return start["status"] >= 400 and header(start.get("headers", ()), b"content-type").startswith(b"text/plain")
