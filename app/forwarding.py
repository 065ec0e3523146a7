"""One HTTP request carried from the ingress (app/ingress.py) to an engine replica through a Serve handle.

A Serve router sees only the arguments of a handle call, never an HTTP body streaming through the proxy, so
the ingress reads the body, works out the prompt's routing key, and hands the request on whole: a
`ForwardedRequest`. The replica answers it with its own HTTP app, the very app that serves it directly
(app/deployment.py build_replica_app), so every check, error shape, stream batching, metric and span is the
same on both paths. `answer_forwarded` runs that app on the request and yields what the app sends (ASGI
`http.response.start`, then `http.response.body` messages), which the ingress relays to its client as they
come. Leaving the generator early (the client left, the ingress cancelled the call) tells the app that the
client disconnected and cancels it, which aborts its engine requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import suppress
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress received it: what a replica's app needs to answer it."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None

    @classmethod
    def from_scope(cls, scope: Scope, body: bytes,
                   extra_headers: dict[str, str] | None = None) -> ForwardedRequest:
        """The request of an ASGI `scope` with its body; `extra_headers` replace headers of the same name."""
        replaced = {name.lower().encode("latin-1") for name in extra_headers or {}}
        headers = [(bytes(k), bytes(v)) for k, v in scope.get("headers", ()) if bytes(k).lower() not in replaced]
        headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (extra_headers or {}).items()]
        client = scope.get("client")
        return cls(scope["method"], app_path(scope), scope.get("query_string", b""), tuple(headers), body,
                   tuple(client) if client else None)

    def scope(self) -> Scope:
        """The ASGI HTTP scope a replica's app is called with."""
        return {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode("latin-1"),
            "query_string": self.query_string, "root_path": "", "headers": [list(h) for h in self.headers],
            "client": self.client, "server": ("127.0.0.1", 80),
        }


def app_path(scope: Scope) -> str:
    """The request's path within the application (under a route prefix, Serve's scope path includes it)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


async def read_body(receive: Receive, limit: int) -> bytes:
    """The request body, or its first `limit` bytes when it is longer (the rest is not read)."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError("the client left before its request body arrived")
        body += message.get("body", b"")
        if len(body) >= limit or not message.get("more_body", False):
            return bytes(body[:limit])


async def answer_forwarded(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[Message]:
    """Run `app` on `request`; yield every message it sends, until the response is complete."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    left = asyncio.Event()  # the consumer stopped reading: the client is gone
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(request.scope(), receive, sent.put)
        finally:
            sent.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        while (message := await sent.get()) is not None:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                break
        await task  # an exception the app raised before answering reaches the ingress
    finally:
        left.set()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
